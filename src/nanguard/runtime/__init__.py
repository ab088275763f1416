"""Runtime primitives the core builds on: distributed.py, the one collective (ranks agree on a
step's verdict) that every part of a torch.distributed job calls the same way."""
