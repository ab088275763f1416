"""One diagnosis: the live finding line and the record come from one computation.

Under `nanguard run --policy raise` the guard closes at the failing step, while the script
is still running; the failing step is pinpointed only afterwards (a re-run: this program
calls its model twice per step with a loss of its own arithmetic, so the step is not
replayed in process). A line that leaves at the raise knows the phase, not the op: it used
to name a cause from that (`exploding_init (30%)`, "nothing measured") that the record,
diagnosed after the re-run, contradicted. It now says the cause follows, and the finding
that leaves once the re-run is done names the record's top cause. The expected step and
phase come from the independent tracer; the op's line from the script's text.
"""

from __future__ import annotations

import re
from pathlib import Path

from programs_support import SCRIPTS, both

ANGLES = "pair_angles.py"


def test_the_live_finding_never_names_a_cause_the_record_contradicts(tmp_path: Path) -> None:
    traced, g = both(tmp_path, ANGLES, "--margin", "0.5",
                     options=("--policy", "raise", "--log-level", "DEBUG"))
    assert traced.first is not None and (traced.first["step"], traced.first["phase"]) == (
        0, "forward"), traced
    line = next(i for i, t in enumerate((SCRIPTS / ANGLES).read_text().splitlines(), 1)
                if "# ACOS LINE" in t)
    assert (g.report["status"], g.first["step"], g.first["phase"], g.first["op"]) == (
        "failed", 0, "forward", "aten.acos"), g.explain()
    assert g.first["source"] == f"{SCRIPTS / ANGLES}:{line}", g.explain()
    assert g.report["run"]["replay"]["status"] == "found", g.explain()  # pinpointed after
    top = g.report["diagnosis"][0]["cause"]
    lines = [ln for ln in g.proc.stderr.splitlines()
             if ln.startswith("nanguard: first non-finite value at step")]
    assert lines, g.explain()
    for ln in lines:
        said = re.search(r": phase (\S+)", ln)  # a phase is said only once an op is found
        assert said is None or said.group(1) == g.first["phase"], (ln, g.first)
        named = re.search(r"; cause (\S+) \(", ln)
        assert (named is None and ln.endswith("; the cause follows")) or (
            named is not None and named.group(1) == top), (ln, top)
    # The line that left at the raise (before the re-run) says the cause follows; the last
    # one, once the re-run is done, names the record's cause and line.
    assert lines[0].endswith("; the cause follows"), lines
    assert f"; cause {top} (" in lines[-1] and g.first["source"] in lines[-1], lines
