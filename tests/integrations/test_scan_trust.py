"""`nanguard scan --trust`: a .pt file holding numpy arrays is refused by default (with the way
to opt in), and read with a one-line warning when the user trusts it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from _run import run


def test_scan_trust_reads_numpy_arrays_inside_a_torch_file(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((20, 3)).astype("float32")
    x[4, 1] = np.nan
    torch.save({"features": x, "labels": np.arange(20)}, tmp_path / "data.pt")
    r = run(["-m", "nanguard", "scan", "data.pt"], cwd=tmp_path)
    assert r.returncode == 2
    assert "nanguard scan --trust data.pt" in r.stderr
    r = run(["-m", "nanguard", "scan", "--trust", "data.pt"], cwd=tmp_path)
    assert r.returncode == 1  # the NaN is a finding
    assert "weights_only=False (--trust)" in r.stderr
    assert "1 NaN value at row 4" in r.stdout + r.stderr
