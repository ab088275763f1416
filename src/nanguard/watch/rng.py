"""RNG states at the start of a step: small, captured every step, serialized only when kept.

Two depths. `capture_step` (every step, on the hot path) takes torch's generators only (CPU and
CUDA, ~1 us): a step's forward and backward draw from torch (dropout, sampling), and a replay
re-runs them on the batch the guard kept, so the data pipeline's Python and NumPy generators
are not needed for it. `capture` also takes Python's and NumPy's (~40 us: NumPy copies its
624-word key word by word): at the start of the run and for the states the record keeps every
`RecordConfig.rng_every` steps, where a re-run of the script may need them.

Serialized with `torch.save` and read back with `torch.load(weights_only=True)`: a run store
shared by someone else can never execute code when a replay reads it.
"""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The RNG states of torch (CPU and every CUDA device), Python and NumPy."""
    # NumPy's state is kept as NumPy gives it (captured every step: no conversion here);
    # `dumps` turns it into tensors for a weights_only-loadable blob.
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def capture_step() -> dict[str, Any]:
    """The torch RNG states only (CPU and every initialized CUDA device): the per-step capture.
    (No `torch.cuda.is_available()`: it costs more than the capture; a CUDA that is not
    available is never initialized.)"""
    state: dict[str, Any] = {"torch": torch.default_generator.get_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the RNGs in `state` (from `capture`, `capture_step` or `loads`) back; generators
    it does not hold are left as they are."""
    torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, *rest = state["numpy"]
        if isinstance(keys, torch.Tensor):  # from `loads`
            keys = keys.numpy().astype(np.uint32)
        np.random.set_state((kind, keys, *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def dumps(state: dict[str, Any]) -> bytes:
    kind, keys, *rest = state.get("numpy", (None, None))
    if isinstance(keys, np.ndarray):
        state = {**state, "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), *rest)}
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def loads(blob: bytes) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(io.BytesIO(blob), weights_only=True)
    return state
