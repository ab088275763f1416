"""Every scenario of the pinpoint suite gets its expected cause ranked first: the op-level
origin of its failing step, with the optimizer's settings, goes through `diagnose`. The cascade
needs its alarms (a whole run): tests/explain/test_rules.py checks it through a Guard."""

from __future__ import annotations

import pytest

from nanguard.explain import Evidence, diagnose
from nanguard.pinpoint import find_origin
from scenarios import HEALTHY, SCENARIOS, load

SINGLE_STEP = [s for s in SCENARIOS if s != "cascade"]


def _evidence(built, origin) -> Evidence:  # type: ignore[no-untyped-def]
    first = origin.to_dict()
    first["step"] = 0  # each scenario's failing step is its first
    group = built.optimizer.param_groups[0]
    return Evidence(
        first_nonfinite=first,
        optimizer=type(built.optimizer).__name__,
        lr=group.get("lr"),
        eps=group.get("eps"),
        dtype=(first.get("output") or {}).get("dtype"),
        n_batch_tensors=len(built.batch) if isinstance(built.batch, (tuple, list)) else 1,
    )


@pytest.mark.parametrize("name", SINGLE_STEP)
def test_expected_cause_ranks_first(name: str) -> None:
    mod = load(name)
    built = mod.build()
    if built.skip:
        pytest.skip(built.skip)
    origin = find_origin(built.step, model=built.model,
                         optimizer=built.notes.get("optimizers", built.optimizer),
                         batch=built.batch)
    assert origin is not None
    causes = diagnose(_evidence(built, origin))
    assert causes, f"no cause for {name}: {origin.to_dict()}"
    assert causes[0].cause == mod.EXPECTED["cause"], [c.cause for c in causes]
    assert causes[0].fix


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_scenarios_get_no_cause(name: str) -> None:
    built = load(name).build()
    origin = find_origin(built.step, model=built.model, optimizer=built.optimizer,
                         batch=built.batch)
    assert origin is None
    assert diagnose(Evidence()) == []
