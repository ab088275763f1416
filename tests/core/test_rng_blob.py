"""RNG states kept in the run store: `rng.dumps` / `rng.loads` round-trip every generator (the
draws after a restore are the draws after the capture), old `torch.save` blobs still load, and
bytes that are neither are refused with a ValueError."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from nanguard.watch import rng


def _draws() -> tuple[list[float], float, list[float], list[float]]:
    return (torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist(),
            [random.gauss(0, 1), float(np.random.standard_normal())])


@pytest.mark.parametrize("capture", [rng.capture, rng.capture_step])
def test_round_trip_restores_the_same_draws(capture):
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    random.gauss(0, 1)  # a cached gaussian in Python's and NumPy's states
    np.random.standard_normal()
    state = capture()
    want = _draws()
    blob = rng.dumps(state)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    rng.restore(rng.loads(blob))
    got = _draws()
    if capture is rng.capture:
        assert got == want
    else:  # torch's generator only
        assert got[0] == want[0]


def test_old_torch_save_blobs_still_load():
    state = rng.capture()
    kind, keys, *rest = state["numpy"]
    old = {**state, "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), *rest)}
    buf = io.BytesIO()
    torch.save(old, buf)
    want = _draws()
    rng.restore(rng.loads(buf.getvalue()))
    assert _draws() == want


@pytest.mark.parametrize("blob", [b"NGRNG1\n\x05\x00\x00\x00{bad", b"NGRNG1\n" + b"\x00" * 3])
def test_damaged_blob_is_a_value_error(blob):
    with pytest.raises(ValueError, match="RNG state"):
        rng.loads(blob)
