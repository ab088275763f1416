"""Runtime primitives the core builds on: distributed.py, the one collective (ranks agree on a
step's verdict) that every part of a torch.distributed job calls the same way; hooks.py, the
wrapper of every hook put on a user's module (a copy of the module leaves it behind)."""
