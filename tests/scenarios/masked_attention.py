"""Attention where every key of sample 1 is masked (an all-padding sequence): the softmax of a
row of -inf is NaN. The -inf fills are intended and never blamed; the origin is
`aten._softmax` in the forward of `attn`."""

import torch

from . import Built
from ._attention import make

EXPECTED = {"phase": "forward", "module": "attn", "op": "aten._softmax", "samples": [1],
            "cause": "masked_softmax"}


def build() -> Built:
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[0, 3:] = False
    keep[1, :] = False
    return make(keep)
