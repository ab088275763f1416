"""Integrations: adapters from frameworks and launchers onto the framework-free core."""
