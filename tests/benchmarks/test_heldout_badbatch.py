"""benchmarks/heldout_badbatch.py without pytorch/examples (the suite cannot fetch it): a
missing or wrong checkout is a one-line error, and the planted batches (the truth every
measure rests on) are where the script says: the corpus read back as word_language_model's
`data.Corpus` reads it and cut as its `batchify` / `get_batch` cut it (re-written here from
their description, not imported) differs from the clean corpus of the same seed exactly in
the planted columns of the planted batches' windows."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import heldout_badbatch  # noqa: E402

BSZ, BPTT = 20, 35


def test_without_a_checkout_it_says_so_in_one_line(tmp_path: Path) -> None:
    for args in ([], [str(tmp_path)]):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "heldout_badbatch.py"),
                               *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "pytorch/examples checkout" in proc.stderr and "Traceback" not in proc.stderr


def _columns(folder: Path) -> np.ndarray:
    """train.txt as words (a line's, then `<eos>`), in BSZ columns (rows x BSZ). (Words, not
    ids: the dictionary numbers words as they first appear, which a plant changes.)"""
    seq = [w for line in (folder / "train.txt").read_text().splitlines()
           for w in [*line.split(), "<eos>"]]
    n = len(seq) // BSZ
    return np.array(seq[:n * BSZ]).reshape(BSZ, n).T


def test_the_planted_batches_are_the_truth(tmp_path: Path) -> None:
    args = argparse.Namespace(vocab=300, tokens=60_000, plants=4, rows="12-20", clean_first=20,
                              batch_size=BSZ, bptt=BPTT)
    clean, per_epoch = heldout_badbatch.make_corpus(tmp_path / "clean", 0, args, plant=False)
    planted, again = heldout_badbatch.make_corpus(tmp_path / "bad", 0, args, plant=True)
    assert clean == {} and len(planted) == 4 and again == per_epoch
    a, b = _columns(tmp_path / "clean"), _columns(tmp_path / "bad")
    assert a.shape == b.shape and per_epoch == len(range(0, a.shape[0] - 1, BPTT))
    differ = a != b
    for batch in range(per_epoch):  # get_batch's inputs (its targets: one row further)
        rows = slice(batch * BPTT, batch * BPTT + BPTT)
        changed = sorted(int(c) for c in np.flatnonzero(differ[rows].any(axis=0)))
        want = planted.get(batch, [])
        assert 12 <= len(want) <= 20 or not want
        if want:
            # (plus the planted batch before's last target, on the first input row only)
            extra = sorted(set(changed) - set(want))
            assert set(want) <= set(changed), (batch, changed, want)
            assert set(extra) <= set(planted.get(batch - 1, [])), (batch, changed, want)
            assert not differ[batch * BPTT + 1:batch * BPTT + BPTT][:, extra].any()
            # ...and the targets of those columns (a repeated word may equal a clean one)
            targets = differ[batch * BPTT + 1:batch * BPTT + BPTT + 1][:, want]
            assert targets.mean() > 0.8
        elif batch - 1 in planted:  # its first input is the planted batch's last target
            assert not differ[batch * BPTT + 1:batch * BPTT + BPTT].any()
            assert set(changed) <= set(planted[batch - 1])
        else:
            assert changed == [], (batch, changed)
