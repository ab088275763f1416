"""Small deterministic training scenarios shipped with the package (used by `nanguard demo`)."""

from nanguard.scenarios.cascade import CascadeSetup, make_cascade, train_cascade

__all__ = ["CascadeSetup", "make_cascade", "train_cascade"]
