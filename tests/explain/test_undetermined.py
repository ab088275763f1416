"""A `failed` report always carries a diagnosis: a cause, or `undetermined` saying what evidence
was missing and how to get it, in the terms of the user's entry point."""

from __future__ import annotations

import pytest

from nanguard.explain.undetermined import undetermined
from nanguard.record.report import build_report

NO_OP = {"step": 4, "phase": None, "module": None, "op": None, "source": None, "samples": [],
         "rank": 0, "signals": ["loss", "grad"]}
ODD_OP = {"step": 4, "phase": "forward", "module": "enc", "op": "aten.erfinv",
          "source": "train.py:40", "samples": [1],
          "inputs": [{"dtype": "float32", "min": -0.5, "max": 0.5}]}


def _failed(first: dict[str, object] | None, **kw: object) -> list[dict[str, object]]:
    report = build_report(steps=5, alarms=[], actions=[], first_nonfinite=first,
                          diagnosis=[], **kw)  # type: ignore[arg-type]
    assert report.status == "failed"
    return report.diagnosis


@pytest.mark.parametrize("entry", ["run", "api", "lightning", "transformers"])
def test_no_op_level_origin_says_how_to_get_one(entry: str) -> None:
    diagnosis = _failed(NO_OP, run={"entry": entry})
    assert [d["cause"] for d in diagnosis] == ["undetermined"]
    d = diagnosis[0]
    assert "no op-level origin" in d["evidence"] and "loss, grad" in d["evidence"]
    knob = {"run": "nanguard run --policy raise", "api": "replay=` (your forward and loss for "
            "a batch) to `Guard(...)`", "lightning": "training_step(batch, 0)` ; one",
            "transformers": "to `NanguardCallback(...)`"}[entry].replace("` ; ", "`; ")
    assert knob in d["fix"], d
    if entry != "run":
        # `nanguard replay` refuses a folder that does not record how to start the script.
        assert "nanguard replay" not in d["fix"] and "under `nanguard run`" in d["fix"], d


def test_an_op_no_rule_explains_names_it_with_its_inputs() -> None:
    d = _failed(ODD_OP, run={"entry": "run"})[0]
    assert d["cause"] == "undetermined"
    assert "aten.erfinv" in d["evidence"] and "train.py:40" in d["evidence"]
    assert "[-0.5, 0.5]" in d["evidence"] and "nanguard replay RUN --step 4" in d["fix"]
    no_ranges = {k: v for k, v in ODD_OP.items() if k != "inputs"}
    assert "input ranges were not recorded" in _failed(no_ranges)[0]["evidence"]
    assert "nanguard replay" not in _failed(ODD_OP, run={"entry": "api"})[0]["fix"]


def test_stopped_before_anything_went_nonfinite() -> None:
    report = build_report(steps=5, alarms=[{"step": 3, "kind": "cascade", "signal": "grad_norm",
                                            "value": 9.0, "message": "m"}],
                          actions=[{"step": 3, "action": "raise", "detail": "d"}],
                          first_nonfinite=None, diagnosis=[], ended="stopped")
    assert report.status == "failed"
    d = report.diagnosis[0]
    assert d["cause"] == "undetermined" and "before any value went non-finite" in d["evidence"]
    assert "cascade" in d["evidence"] and "step 3" in d["evidence"]


def test_a_diagnosis_with_causes_is_left_alone_and_other_statuses_get_none() -> None:
    cause = {"cause": "data_nonfinite", "confidence": 0.95, "evidence": "e", "fix": "f"}
    report = build_report(steps=5, alarms=[], actions=[], first_nonfinite=NO_OP,
                          diagnosis=[cause])
    assert report.diagnosis == [cause]
    healthy = build_report(steps=5, alarms=[], actions=[], first_nonfinite=None, diagnosis=[])
    assert (healthy.status, healthy.diagnosis) == ("healthy", [])


def test_the_entry_claims_nothing() -> None:
    c = undetermined(NO_OP, alarms=[], actions=[])
    assert c.confidence == 0.0 and c.evidence and c.fix
