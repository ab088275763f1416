"""A bad batch's rows named on a sequence-first program under `nanguard run`.

`tests/programs/scripts/rnn_lm.py` is word_language_model's layout: the corpus batchified into
10 columns, each batch `(bptt, 10)` (time first), the targets flattened time-major
(`.view(-1)`), an LSTM with its hidden state carried across batches, the script's own clip and
hand-written SGD. The corpus written here (a sparse chain over 200 words) repeats one new word
over the same 13-token window in 6 of the 10 columns: batch 38 of every epoch, with those
columns, known from the plant. Its gradient spikes ~6x; its batch loss is no outlier (the
clean columns hold it down), its corrupted columns' own losses are. A one-sample replay of
dim 0 is one time step of all 10 columns: the recorded step is replayed again on dim 1, and
the rows named are planted columns (before: none, "dim 0 is not its sample axis").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from nanguard.run.runner import RunOptions, run

SCRIPT = Path(__file__).parents[1] / "programs" / "scripts" / "rnn_lm.py"
BATCH, BPTT, COLUMNS = 38, 12, [1, 2, 4, 5, 7, 8]


def _corpus(path: Path) -> None:
    """rnn_lm.py's `--data`: 80% of the lines its training stream, 10% each valid / test."""
    rnd = random.Random(0)
    words = [f"w{i}" for i in range(200)]  # ln 200 = 5.3: a clean row predicts far better
    succ = {w: rnd.sample(words, 3) for w in words}

    def stream(n: int) -> list[str]:
        out, w = [], "w0"
        while len(out) < n:
            w = rnd.choices(succ[w], weights=[6, 3, 1])[0]
            out.append(w)
            if rnd.random() < 0.12:
                out.append("<eos>")
        return [*out, "<eos>"]

    train = stream(6000)
    per_column = len(train) // 10  # batchify: column j is tokens [j * L, (j + 1) * L)
    for j in COLUMNS:
        start = j * per_column + BATCH * BPTT
        train[start:start + BPTT + 1] = ["zebra"] * (BPTT + 1)  # inputs and targets

    def lines(tokens: list[str]) -> list[str]:  # each ends at an <eos>, as tokenize adds it
        out: list[str] = []
        cur: list[str] = []
        for t in tokens:
            if t == "<eos>":
                out.append(" ".join(cur))
                cur = []
            else:
                cur.append(t)
        return out

    ours, rest = lines(train), lines(stream(1500))
    n = len(ours) * 5 // 4
    while int(0.8 * n) != len(ours):
        n += 1
    path.write_text("\n".join(ours + rest[:n - len(ours)]) + "\n")


def test_a_sequence_first_bad_batch_has_its_columns_named(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    _corpus(data)
    out = tmp_path / "run"
    assert run(RunOptions(script=str(SCRIPT), args=[
        "--data", str(data), "--max-iters", "150", "--epochs", "3", "--log-interval", "50",
        "--save", str(tmp_path / "model.pt")], out=str(out), summary=False)) == 0
    report = json.loads((out / "report.json").read_text())
    per_epoch = report["steps"] // 3
    named = [s for s in report["spikes"] if s.get("cause") == "bad_batch"]
    assert named, (report["status"], report["spikes"])
    for spike in named:  # the planted batch of an epoch, its rows among the planted columns
        assert spike["step"] % per_epoch == BATCH and not spike.get("error"), spike
        assert spike["rows"] and set(spike["rows"]) <= set(COLUMNS), spike
    assert any(s["rows"] == COLUMNS for s in named), named  # every planted column, once
