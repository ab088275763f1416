"""The diagnosis reads the preflight's evidence (`Evidence.preflight`, set from
`guard.preflight` by `nanguard run --preflight`): exploding_init ranked with the measured init
ratio of the failing layer (also past step 2, where the run's own magnitudes alone do not
reach), and lowered when the preflight measured every layer in range; optimizer_divergence
quoting the probe's divergence LR and proposing a tenth of it. Each with its negative side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import Guard
from nanguard.explain import diagnose
from nanguard.explain.context import evidence_from_log
from nanguard.explain.evidence import Evidence
from nanguard.step.state import RunFacts


def _init_finding(name: str, ratio: float) -> dict[str, Any]:
    call = f"nn.init.kaiming_normal_(model.get_submodule({name!r}).weight, nonlinearity='relu')"
    return {"code": "exploding_init", "severity": "error", "location": name,
            "message": "", "fix": f"{call}, or drop the custom init",
            "details": {"std": 1.0, "ratio": ratio, "fan_in": 128, "init_call": call}}


def _preflight(findings: list[dict[str, Any]], ratios: dict[str, float] | None = None,
               diverge: float | None = None) -> dict[str, Any]:
    layers = [{"name": n, "fan_in": 128, "std": r / 11.3, "ratio": r}
              for n, r in (ratios or {}).items()]
    return {"ran": True, "findings": findings, "layers": layers,
            "overfit": {"first_loss": 2.26e7, "final_loss": 2.3, "steps": 100,
                        "success": True},
            "lr_probe": {"diverge_lr": diverge,
                         "suggested_lr": diverge / 10 if diverge else None}}


def _causes(ev: Evidence) -> dict[str, Any]:
    return {c.cause: c for c in diagnose(ev)}


def _failing_at(step: int, module: str = "net.6") -> dict[str, Any]:
    return {"step": step, "phase": "forward", "module": module, "op": "aten.addmm"}


def test_exploding_init_ranked_with_the_failing_layers_measured_ratio() -> None:
    history = [{"step": 0, "loss": 2.0e7, "grad_norm": 1.3e7, "act_max": None, "lr": 0.01},
               {"step": 1, "loss": 2.9e31, "grad_norm": 1.2e28, "act_max": None, "lr": 0.01}]
    ev = Evidence(first_nonfinite=_failing_at(3), history=history, lr=0.01, optimizer="SGD",
                  momentum=0.9, preflight=_preflight(
                      [_init_finding("net.2", 11.3), _init_finding("net.6", 11.4)],
                      diverge=1.8e-5))
    causes = diagnose(ev)
    assert causes[0].cause == "exploding_init"
    top = causes[0]
    assert top.confidence == 0.92
    assert "the failing layer `net.6`: weight std 1 = 11.4x 1/sqrt(fan_in)" in top.evidence
    assert "1 more layer(s) (net.2)" in top.evidence
    assert "the untrained model's loss on the first batch was 2.26e+07" in top.evidence
    assert top.fix.startswith("nn.init.kaiming_normal_(model.get_submodule('net.6').weight")
    # Without the preflight the same run reads as a divergence only (a jump after an update).
    plain = _causes(Evidence(first_nonfinite=_failing_at(3), history=history, lr=0.01,
                             optimizer="SGD", momentum=0.9))
    assert "exploding_init" not in plain and "optimizer_divergence" in plain


def test_flagged_layers_elsewhere_rank_lower_than_the_failing_one() -> None:
    ev = Evidence(first_nonfinite=_failing_at(1, module="head"),
                  preflight=_preflight([_init_finding("net.2", 11.3)]))
    cause = _causes(ev)["exploding_init"]
    assert cause.confidence == 0.9 and "the failing layer" not in cause.evidence
    late = Evidence(first_nonfinite=_failing_at(50), preflight=_preflight(
        [_init_finding("net.6", 11.4)]))
    assert "exploding_init" not in _causes(late)  # long after the start: not the init's
    loaded = Evidence(first_nonfinite={**_failing_at(0), "kind": "state"},
                      preflight=_preflight([_init_finding("net.6", 11.4)]))
    assert "exploding_init" not in _causes(loaded)


def test_a_preflight_that_measured_a_sane_init_lowers_exploding_init() -> None:
    history = [{"step": 0, "loss": 3.0, "grad_norm": None, "act_max": 5e7, "lr": 1e-3}]
    base = dict(first_nonfinite=_failing_at(0), history=history)
    alone = _causes(Evidence(**base))["exploding_init"]
    sane = _causes(Evidence(**base, preflight=_preflight(
        [], ratios={"net.0": 0.58, "net.2": 0.61})))["exploding_init"]
    assert sane.confidence == alone.confidence / 2
    assert "measured every layer's init within range (largest: `net.2` at 0.61x" in \
        sane.evidence


def test_optimizer_divergence_quotes_the_probes_divergence_lr() -> None:
    history = [{"step": s, "loss": 1.0, "grad_norm": 1.0, "act_max": None, "lr": 0.05}
               for s in range(6)]
    history.append({"step": 6, "loss": 1e3, "grad_norm": 1e4, "act_max": None, "lr": 0.05})
    base = dict(first_nonfinite=_failing_at(8), history=history, lr=0.05, optimizer="SGD",
                momentum=0.9)
    alone = _causes(Evidence(**base))["optimizer_divergence"]
    above = _causes(Evidence(**base, preflight=_preflight([], diverge=0.02)))[
        "optimizer_divergence"]
    assert "the preflight's LR probe diverged at lr 0.02 on the first batch, below your " \
        "lr=0.05" in above.evidence
    assert "lr=0.05 -> lr=0.002" in above.fix and "a tenth of the preflight's" in above.fix
    assert above.confidence > alone.confidence
    below = _causes(Evidence(**base, preflight=_preflight([], diverge=0.5)))[
        "optimizer_divergence"]
    assert "your lr=0.05 is below it" in below.evidence
    assert below.confidence == alone.confidence and below.fix == alone.fix


def test_evidence_reads_the_guards_preflight(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, out=str(tmp_path / "a")) as guard:
        assert evidence_from_log(guard.run_log()).preflight is None
    verdict = _preflight([], diverge=0.3)
    with Guard(model, opt, out=str(tmp_path / "b"), facts=RunFacts(preflight=verdict)) as guard:
        assert evidence_from_log(guard.run_log()).preflight == verdict
    with Guard(model, opt, out=str(tmp_path / "c"),
               facts=RunFacts(preflight={"ran": False, "reason": "x"})) as guard:
        assert evidence_from_log(guard.run_log()).preflight is None
