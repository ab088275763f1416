"""The policy stage decides from a step's statistics and alarms alone (no model, no Guard)."""

from __future__ import annotations

import math

import pytest

from nanguard.config import default_act_on
from nanguard.detect import Alarm
from nanguard.policy import make_policy, wants_to_act
from nanguard.watch.stats import StepStats


def _stats(*, grad: float = 1.0, param: float = 2.0, skipped: bool = False) -> StepStats:
    s = StepStats(step=7, loss=0.5, grad_norms={0: grad}, param_norms={0: param})
    if not math.isfinite(grad):
        s.nonfinite_grads.add(0)
    s.skipped = skipped
    return s


def _spike() -> Alarm:
    return Alarm(step=7, kind="spike", signal="grad_norm", value=40.0, message="40x")


def test_nonfinite_gradient_calls_for_acting_before_the_update_only() -> None:
    bad = _stats(grad=math.nan)
    assert wants_to_act(bad, [], default_act_on("skip"), post=False)
    # After the update only what the update produced counts (parameters, optimizer state).
    assert not wants_to_act(bad, [], default_act_on("skip"), post=True)
    assert wants_to_act(_stats(param=math.inf), [], default_act_on("skip"), post=True)
    assert not wants_to_act(_stats(), [], default_act_on("skip"), post=False)


def test_a_data_row_the_scaler_skipped_leaves_nothing_to_act_on() -> None:
    s = _stats()
    s.dropped_samples = [3]
    assert s.seal() == ["data"]
    assert not wants_to_act(s, [], default_act_on("rollback"), post=False)


def test_skip_discards_then_escalates_after_the_limit() -> None:
    policy = make_policy("skip", default_act_on("skip"), max_consecutive_skips=3)
    bad = _stats(grad=math.nan)
    assert policy.decide(bad, [], post=False, skips_in_row=0).action == "skip"
    assert policy.decide(bad, [], post=False, skips_in_row=2).action == "skip"
    assert policy.decide(bad, [], post=False, skips_in_row=3).action == "escalate"
    # After the update: made non-finite by the update itself, it can no longer be skipped.
    assert policy.decide(_stats(param=math.inf), [], post=True,
                         skips_in_row=0).action == "cannot_skip"
    assert policy.decide(_stats(param=math.inf, skipped=True), [], post=True,
                         skips_in_row=1).action == "none"


def test_rollback_only_discards_a_spike_seen_before_its_update() -> None:
    policy = make_policy("rollback", default_act_on("rollback"))
    d = policy.decide(_stats(grad=500.0), [_spike()], post=False, skips_in_row=0)
    assert d.action == "discard_spike" and d.why == "spike:grad_norm"
    assert policy.decide(_stats(grad=math.nan), [_spike()], post=False,
                         skips_in_row=0).action == "rollback"
    assert policy.decide(_stats(param=math.inf), [], post=True,
                         skips_in_row=0).action == "rollback"


def test_raise_stops_and_says_why() -> None:
    d = make_policy("raise", default_act_on("raise")).decide(
        _stats(grad=math.inf), [], post=False, skips_in_row=0)
    assert d.action == "raise" and d.why == "grad"


@pytest.mark.parametrize("rank", [None, 1])
def test_the_reason_names_the_rank_that_failed_first(rank: int | None) -> None:
    s = _stats(grad=math.nan)
    s.agreed_bad_rank = rank
    d = make_policy("skip", default_act_on("skip")).decide(s, [], post=False, skips_in_row=0)
    assert d.why == ("grad" if rank is None else "grad; non-finite first on rank 1")
