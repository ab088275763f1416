"""Show: the terminal summary (rich)."""
