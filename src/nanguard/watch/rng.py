"""RNG states at the start of a step: small, captured every step, serialized only when kept.

Two depths. `capture_step` (every step, on the hot path) takes torch's generators only (CPU and
CUDA, ~1 us): a step's forward and backward draw from torch (dropout, sampling), and a replay
re-runs them on the batch the guard kept, so the data pipeline's Python and NumPy generators
are not needed for it. `capture` also takes Python's and NumPy's (~40 us: NumPy copies its
624-word key word by word): at the start of the run and for the states the record keeps every
`RecordConfig.rng_every` steps, where a re-run of the script may need them.

Serialized as raw bytes behind a JSON header (`dumps`): a run store shared by someone else can
never execute code when a replay reads it (older stores hold `torch.save` blobs, read with
`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import io
import json
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


_MAGIC = b"NGRNG1\n"


def dumps(state: dict[str, Any]) -> bytes:
    """`state` (from `capture` or `capture_step`) as bytes: a short JSON header and the raw
    generator states, no pickle (~20x faster than `torch.save`, which it replaced; `loads`
    still reads those older blobs)."""
    blobs: list[bytes] = []
    head: dict[str, Any] = {}
    if "torch" in state:
        blobs.append(state["torch"].numpy().tobytes())
        head["torch"] = len(blobs[-1])
    if "cuda" in state:
        head["cuda"] = []
        for t in state["cuda"]:
            blobs.append(t.cpu().numpy().tobytes())
            head["cuda"].append(len(blobs[-1]))
    if "python" in state:
        version, internal, gauss = state["python"]
        blobs.append(np.asarray(internal, dtype=np.uint32).tobytes())
        head["python"] = [version, gauss, len(blobs[-1])]
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        if isinstance(keys, torch.Tensor):
            keys = keys.numpy()
        blobs.append(np.asarray(keys, dtype=np.uint32).tobytes())
        head["numpy"] = [kind, int(pos), int(has_gauss), float(cached), len(blobs[-1])]
    header = json.dumps(head).encode()
    return b"".join([_MAGIC, len(header).to_bytes(4, "little"), header, *blobs])


def loads(blob: bytes) -> dict[str, Any]:
    """What `dumps` wrote (or, for stores of older versions, a `torch.save` blob, read with
    `weights_only=True`: never code). Raises ValueError on a damaged blob of `dumps`'s format
    (anything else is handed to `torch.load`, which raises its own error)."""
    if not blob.startswith(_MAGIC):
        state: dict[str, Any] = torch.load(io.BytesIO(blob), weights_only=True)
        return state
    try:
        pos = len(_MAGIC)
        n = int.from_bytes(blob[pos : pos + 4], "little")
        head = json.loads(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n

        def take(size: int) -> bytes:
            nonlocal pos
            part = blob[pos : pos + size]
            if len(part) != size:
                raise ValueError("truncated")
            pos += size
            return part

        out: dict[str, Any] = {}
        if "torch" in head:
            out["torch"] = torch.frombuffer(bytearray(take(head["torch"])), dtype=torch.uint8)
        if "cuda" in head:
            out["cuda"] = [torch.frombuffer(bytearray(take(k)), dtype=torch.uint8)
                           for k in head["cuda"]]
        if "python" in head:
            version, gauss, size = head["python"]
            words = np.frombuffer(take(size), dtype=np.uint32)
            out["python"] = (version, tuple(words.tolist()), gauss)
        if "numpy" in head:
            kind, npos, has_gauss, cached, size = head["numpy"]
            keys = np.frombuffer(take(size), dtype=np.uint32).copy()
            out["numpy"] = (kind, keys, npos, has_gauss, cached)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a readable RNG state ({exc})") from None
    return out
