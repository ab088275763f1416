"""Healthy: padding masks with -inf on some keys, never a fully masked row. No origin."""

import torch

from . import Built
from ._attention import make

EXPECTED = {"phase": None, "module": None, "op": None, "samples": None, "cause": None}


def build() -> Built:
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[0, 3:] = False
    keep[2, 1:] = False
    return make(keep)
