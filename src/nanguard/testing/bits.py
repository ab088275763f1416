"""Flip one bit of one element of a tensor, in place: the primitive of the fault injector.

A flipped bit is what silent data corruption looks like (a cosmic ray in SRAM, a marginal
core, a bad DIMM): no error is raised, one value is simply different. The flip is done on the
element's integer view, so it is exact for every dtype and every bit, the sign and the
exponent included.
"""

from __future__ import annotations

import math

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Mantissa width (stored bits) of the float dtypes: bit `m` is the lowest exponent bit,
# `width - 2` the highest, `width - 1` the sign.
_MANTISSA = {
    torch.float64: 52,
    torch.float32: 23,
    torch.float16: 10,
    torch.bfloat16: 7,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
}


def mantissa_bits(dtype: torch.dtype) -> int:
    """Stored mantissa bits of a float dtype (23 for float32): bits 0 .. n-1 are the mantissa.

    Raises:
        ValueError: not a float dtype nanguard knows.
    """
    if dtype not in _MANTISSA:
        raise ValueError(f"{dtype}: not a float dtype (one of {sorted(map(str, _MANTISSA))})")
    return _MANTISSA[dtype]


def top_exponent_bit(dtype: torch.dtype) -> int:
    """Index of the highest exponent bit (30 for float32, 14 for float16 and bfloat16).

    Flipping it in a value of magnitude below 2 multiplies it by 2**(2**(e-1)) (2**128 for
    float32): the classic catastrophic flip.
    """
    mantissa_bits(dtype)  # validates
    return torch.finfo(dtype).bits - 2


def unravel(flat: int, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Row-major multi-index of flat position `flat` in a tensor of `shape`."""
    index = []
    for size in reversed(tuple(shape)):
        flat, rem = divmod(flat, size)
        index.append(rem)
    return tuple(reversed(index))


def flip_bit(tensor: torch.Tensor, index: tuple[int, ...], bit: int) -> tuple[float, float]:
    """Flip bit `bit` (0 = least significant) of element `index` of `tensor`, in place.

    Runs immediately, outside autograd (the tensor's storage is changed; its version counter
    is bumped, so do not flip a tensor an autograd graph still needs for its backward).

    Returns:
        (old value, new value) as Python floats.

    Raises:
        ValueError: a bit outside the element, an index of the wrong rank, or an unsupported
            dtype (complex, bool).
    """
    size = tensor.element_size()
    if tensor.is_complex() or tensor.dtype == torch.bool or size not in _INT_VIEW:
        raise ValueError(f"flip_bit: unsupported dtype {tensor.dtype}")
    if not 0 <= bit < size * 8:
        raise ValueError(f"flip_bit: bit {bit} outside a {size * 8}-bit {tensor.dtype} element")
    if len(index) != tensor.dim():
        raise ValueError(f"flip_bit: index {index} for a tensor of shape {tuple(tensor.shape)}")
    int_type = _INT_VIEW[size]
    mask = 1 << bit
    if int_type != torch.uint8 and bit == size * 8 - 1:
        mask = -mask  # the sign bit of a signed integer view
    with torch.no_grad():
        elem = tensor.detach()[index]  # a 0-d view of the element, sharing storage
        old = float(elem.item())
        elem.view(int_type).bitwise_xor_(torch.tensor(mask, dtype=int_type, device=elem.device))
        new = float(elem.item())
    return old, new


def describe(old: float, new: float) -> str:
    """'0.0123 -> 4.19e+36' in one short phrase, for logs and assertion messages."""
    if math.isfinite(old) and math.isfinite(new) and old != 0:
        return f"{old:.6g} -> {new:.6g} (x{new / old:.3g})"
    return f"{old:.6g} -> {new:.6g}"
