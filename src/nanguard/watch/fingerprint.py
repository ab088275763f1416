"""Per-sample batch fingerprints computed on the device.

A fingerprint is a position-weighted sum of the raw bits of each sample, masked to 52 bits so it
travels exactly inside the float64 vector that the guard reads once per step. It identifies a
sample (same bytes, same fingerprint), which is what the record and a replay need; it is not a
cryptographic hash.

Definition (what every device computes, bit for bit): each row's elements, viewed as integers
of their own width, times odd position weights, summed with wrapping arithmetic: modulo 2**32
for elements of up to 4 bytes (an int32 result), modulo 2**64 for 8-byte ones (int64). Modular
sums do not depend on the order of the additions, so the CPU computes them with one integer
matrix-vector product (`torch.mv`: no temporary of the batch's size; a 128 x 3 x 224 x 224
float32 batch costs ~5 ms instead of ~136 ms) and other devices, which have no integer `mv`,
with a product and a sum.
"""

from __future__ import annotations

import torch

_MASK = (1 << 52) - 1
_WEIGHTS: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def weights(width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (width, device, dtype)
    w = _WEIGHTS.get(key)
    if w is None:
        # Odd multipliers from a fixed LCG: position-dependent, so permuted features differ.
        w = (torch.arange(width, dtype=torch.int64, device=device) * 2654435761 + 97531) | 1
        if dtype == torch.int32:
            w = (w & 0x7FFFFFFF).to(torch.int32)
        _WEIGHTS[key] = w
    return w


def sample_sums(tensor: torch.Tensor) -> torch.Tensor:
    """The unmasked row sums behind `sample_fingerprints` (see the module docstring): int32 for
    elements of up to 4 bytes, int64 for 8-byte ones.

    Masking to 52 bits is a reduction modulo 2**52, which int64 wrapping (modulo 2**64)
    respects: a caller combining several tensors in int64 can mask once at the end and get
    exactly what masking each sum and each combination gives (`BatchProbe.observe` does:
    fewer ops).
    """
    # Every view below is a tensor object to allocate and free: made only where needed (a
    # batch tensor rarely requires grad, is usually contiguous and often 2-D already).
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dim() == 0:
        t = t.reshape(1)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    bits = t.view(_INT_VIEW[size])
    if bits.dim() != 2:
        bits = bits.reshape(t.shape[0], -1)
    wide = torch.int64 if size == 8 else torch.int32
    if bits.dtype != wide:  # 1- and 2-byte elements, widened to int32 (as a product would)
        bits = bits.to(wide)
    w = _WEIGHTS.get((bits.shape[1], bits.device, wide))  # made once (`weights`): no call
    if w is None:
        w = weights(bits.shape[1], bits.device, wide)
    if bits.device.type == "cpu":
        return torch.mv(bits, w)
    return torch.mul(bits, w).sum(dim=1, dtype=wide)


def sample_fingerprints(tensor: torch.Tensor) -> torch.Tensor:
    """Fingerprint each sample (row along dim 0) of `tensor`.

    Returns:
        A float64 device tensor of shape [batch] holding integers below 2**52.
    """
    return (sample_sums(tensor) & _MASK).to(torch.float64)

