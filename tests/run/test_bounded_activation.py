"""An inf a forward op made that the next op bounded (a tanh RNN cell at a far too high LR:
its pre-activation overflows, the tanh reads it as 1, the loss stays finite) is not "stepped
over by your own non-finite check": the summary says the value never left the forward, and
it is found at the step the script itself saw it (activations are read every step of an alarm
episode)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from in_process import nanguard
from nanguard.show.summary import _stepped_over

SCRIPT = str(Path(__file__).parent / "scripts" / "tanh_rnn.py")


def test_an_inf_the_tanh_bounded_is_said_to_be_bounded(tmp_path: Path) -> None:
    r = nanguard(["run", "--out", str(tmp_path / "r"), SCRIPT, "--learning-rate", "1000",
                  "--steps", "24"], tmp_path)
    # The script's own look at its cell: the first step with an inf before the tanh, and
    # that step's loss, finite.
    seen = re.search(r"^step (\d+): pre-activation inf, loss \S+ finite True", r.stdout, re.M)
    assert seen is not None, r.stdout[-2000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    first = report["first_nonfinite"]
    assert first["signals"] == ["activation"] and first["module"] == "cell.xh_to_h", first
    said = " ".join(r.stderr.split())
    assert "bound the value (a tanh or clamp reads an inf as finite)" in said, said[-3000:]
    assert "your own non-finite check" not in said
    # Found at the step the script saw it: alarms came before it, and through an alarm
    # episode the activations are read every step (not every 10: it was found 2 steps late).
    assert first["step"] == int(seen.group(1)), (first["step"], seen.group(0))
    assert any(a["step"] < first["step"] for a in report["alarms"]), report["alarms"]


def test_a_forward_the_script_stepped_over_keeps_its_words() -> None:
    # No re-run under the op checker (a Guard without `replay=`): what the signals say.
    text = _stepped_over({"skipped_by": "script", "signals": ["activation"]})
    assert text is not None and "your own non-finite check" in text
    # A value the re-run saw flow on into the loss was stepped over by the script.
    flowed = {"skipped_by": "script", "kind": "op", "phase": "forward",
              "propagated_by": {"op": "aten.mse_loss"}}
    assert "your own non-finite check" in (_stepped_over(flowed) or "")
