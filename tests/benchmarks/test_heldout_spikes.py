"""benchmarks/heldout_spikes.py without nanoGPT (the suite cannot fetch it): a missing or
wrong checkout is a one-line error, and the planted data (the truth every measure of the
`bad` cause rests on) is what the docstring says: uint16 ids as nanoGPT's prepare.py writes
them, corrupted regions where the script says, rows counted corrupted only when mostly inside
one."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import heldout_spikes  # noqa: E402


def test_without_a_checkout_it_says_so_in_one_line(tmp_path: Path) -> None:
    for args in ([], [str(tmp_path)]):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "heldout_spikes.py"),
                               *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "nanoGPT checkout" in proc.stderr and "Traceback" not in proc.stderr


def test_the_planted_regions_are_the_truth(tmp_path: Path) -> None:
    args = argparse.Namespace(regions=4, region_len=1000)
    clean = heldout_spikes.make_data(tmp_path / "clean", 0, args, bad=False)
    regions = heldout_spikes.make_data(tmp_path / "bad", 0, args, bad=True)
    assert clean == [] and len(regions) == 4
    assert [k for _, _, k in regions] == ["repeat", "random", "codetable", "repeat"]
    a = np.fromfile(tmp_path / "clean" / "train.bin", dtype=np.uint16)
    b = np.fromfile(tmp_path / "bad" / "train.bin", dtype=np.uint16)
    assert a.max() < 65 and b.max() < 65 and len(a) == len(b) == 270_000
    inside = np.zeros(len(a), dtype=bool)
    for s, e, kind in regions:
        inside[s:e] = True
        if kind == "repeat":
            assert len(set(b[s:e].tolist())) == 1
    assert (a[~inside] == b[~inside]).all()  # nothing else changed
    assert (a[inside] != b[inside]).mean() > 0.5
    s = regions[0][0]
    # a row of 33 symbols (x and y of block 32): counted when more than half is inside
    assert heldout_spikes.corrupted_rows(np.array([s - 10, s - 20, 5]), regions, 32) == [0]
