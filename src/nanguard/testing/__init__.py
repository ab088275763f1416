"""Tools for testing numerical health checks: a seeded bit-flip fault injector.

Public API: `FaultInjector` (flip a bit of a parameter, gradient, activation or optimizer-state
element at a given step and rank), `Flip` (what it planned and what it flipped), and the
primitives `flip_bit`, `top_exponent_bit`, `mantissa_bits`.
"""

from nanguard.testing.bits import flip_bit, mantissa_bits, top_exponent_bit
from nanguard.testing.faults import TARGETS, FaultInjector, Flip

__all__ = ["TARGETS", "FaultInjector", "Flip", "flip_bit", "mantissa_bits", "top_exponent_bit"]
