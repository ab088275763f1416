"""The rule behind which spike `skip` (and `rollback`'s discard) answers (`policy.recurrence`),
decided from a step's statistics and alarms alone, and the effects it turns into."""

from __future__ import annotations

from types import SimpleNamespace

from nanguard.config import default_act_on
from nanguard.detect import Alarm
from nanguard.policy import make_policy
from nanguard.policy.act import effects_of
from nanguard.policy.lr_change import FOLLOWS, LrChanges
from nanguard.policy.recurrence import RECUR_STEPS, after_jump
from nanguard.recover.effects import Discard, Record
from nanguard.watch.stats import StepStats


def _stats(step: int) -> StepStats:
    return StepStats(step=step, loss=0.5, grad_norms={0: 9.0}, param_norms={0: 2.0})


def _spike(step: int, cause: str | None = None, kind: str = "spike") -> list[Alarm]:
    return [Alarm(step=step, kind=kind, signal="grad_norm", value=9.0, message="9x",
                  cause=cause)]


def _decide(policy, step: int, alarms: list[Alarm]):
    return policy.decide(_stats(step), alarms, post=False, skips_in_row=0)


def test_skip_answers_a_lone_spike_and_holds_its_recurrences() -> None:
    policy = make_policy("skip", default_act_on("skip"))
    first = _decide(policy, 100, _spike(100))
    assert first.action == "skip" and first.lone is not None
    second = _decide(policy, 105, _spike(105))
    assert second.action == "hold" and second.say
    assert "the 2nd grad-norm spike in 6 steps (since step 100)" in second.why
    third = _decide(policy, 110, _spike(110))
    assert third.action == "hold" and not third.say  # said once per instability
    # Quiet for longer than the window: the next one is lone again.
    assert _decide(policy, 111 + RECUR_STEPS, _spike(111 + RECUR_STEPS)).action == "skip"


def test_a_traced_bad_batch_is_skipped_and_never_counts_towards_recurrence() -> None:
    policy = make_policy("skip", default_act_on("skip"))
    assert _decide(policy, 100, _spike(100)).action == "skip"
    d = _decide(policy, 104, _spike(104, cause="bad_batch"))
    assert d.action == "skip" and d.lone is None
    assert _decide(policy, 108, _spike(108)).action == "hold"  # 2nd untraced, 8 steps on
    policy = make_policy("skip", default_act_on("skip"))
    for step in (10, 12, 14):
        assert _decide(policy, step, _spike(step, cause="bad_batch")).action == "skip"
    assert _decide(policy, 16, _spike(16)).action == "skip"  # the first untraced one


def test_a_cascade_is_held_and_a_post_update_cascade_claims_nothing_non_finite() -> None:
    policy = make_policy("skip", default_act_on("skip"))
    d = _decide(policy, 50, _spike(50, kind="cascade"))
    assert d.action == "hold" and d.say and "feeding its own growth back" in d.why
    post = policy.decide(_stats(51), _spike(51, kind="cascade"), post=True, skips_in_row=0)
    assert post.action == "none"  # was "cannot_skip": "non-finite after the update"
    # Another rank's cascade (no alarm here): the same answer on this rank...
    assert policy.decide(_stats(51), [], post=True, skips_in_row=0).action == "none"
    # ...but a non-finite value on another rank (agreed) is that rank's "cannot skip" here too.
    other = _stats(51)
    other.agreed_bad_rank = 1
    assert policy.decide(other, [], post=True, skips_in_row=0).action == "cannot_skip"


def test_rollback_discards_a_lone_spike_and_holds_a_recurring_one() -> None:
    policy = make_policy("rollback", default_act_on("rollback"))
    assert _decide(policy, 30, _spike(30)).action == "discard_spike"
    assert _decide(policy, 35, _spike(35)).action == "hold"


def test_effects_a_hold_is_recorded_once_and_a_lone_spike_after_a_jump_is_held() -> None:
    changes = LrChanges()
    changes.see(0, 1e-3)  # the LR of the run's first step
    assert changes.see(200, 1e-2) is not None  # a 10x jump at step 200
    recovery = SimpleNamespace(lr_changes=changes, link=SimpleNamespace(spikes=list))
    policy = make_policy("skip", default_act_on("skip"))
    d = _decide(policy, 203, _spike(203))
    assert d.action == "skip" and d.lone is not None  # lone, as far as the policy knows
    effects, row = effects_of(d, _stats(203), recovery=recovery, post=False, skips_in_row=0,
                              limit=10)
    assert row == 0 and len(effects) == 1 and isinstance(effects[0], Record)
    assert effects[0].action == "not_skipped" and "10x at step 200" in effects[0].detail
    # Its next spike is a recurrence the policy holds itself, silently (said already).
    d = _decide(policy, 208, _spike(208))
    assert d.action == "hold" and not d.say
    assert effects_of(d, _stats(208), recovery=recovery, post=False, skips_in_row=0,
                      limit=10) == ([], 0)
    assert after_jump(200 + FOLLOWS, changes.jump) is None
    # A hold the policy made itself (a cascade) right after the jump is said as the jump's.
    policy = make_policy("skip", default_act_on("skip"))
    d = _decide(policy, 201, _spike(201, kind="cascade"))
    effects, _ = effects_of(d, _stats(201), recovery=recovery, post=False, skips_in_row=0,
                            limit=10)
    assert len(effects) == 1 and "1 step(s) after the LR went 10x" in effects[0].detail
    # Without a jump a lone spike's update is discarded.
    policy = make_policy("skip", default_act_on("skip"))
    d = _decide(policy, 400, _spike(400))
    quiet = SimpleNamespace(lr_changes=LrChanges(), link=SimpleNamespace(spikes=list))
    effects, row = effects_of(d, _stats(400), recovery=quiet, post=False, skips_in_row=0,
                              limit=10)
    assert row == 1 and isinstance(effects[0], Discard)


def test_a_replay_that_measured_every_row_and_found_none_out_rules_the_batch_out() -> None:
    from nanguard.detect import bad_batch

    def entry(found: dict) -> list[Alarm]:
        alarms = _spike(60)
        bad_batch.spike_entry(_stats(60), alarms[0], found)
        return alarms

    measured = {"rerun": {"verdict": "reproducible"}, "samples": [], "loss_samples": []}
    assert bad_batch.ruled_out(entry(measured))
    assert not bad_batch.ruled_out(entry({**measured, "samples": [{"index": 4, "z": 12.0}]}))
    # A row out, short of naming the batch (the README demo's outlier at z 8.6), is no
    # evidence against the batch: not ruled out.
    assert not bad_batch.ruled_out(entry({**measured, "samples": [{"index": 4, "z": 8.6}]}))
    # A few rows' losses a few sigma out are a batch's ordinary spread: still ruled out.
    assert bad_batch.ruled_out(entry({**measured, "loss_samples": [
        {"index": 4, "loss": 2.0, "z": 6.2}]}))
    assert not bad_batch.ruled_out(entry({"samples": []}))  # no replay: nothing measured
    assert not bad_batch.ruled_out(entry({**measured, "error": "per-sample gradients failed"}))
    policy = make_policy("skip", default_act_on("skip"))
    d = policy.decide(_stats(60), entry(measured), post=False, skips_in_row=0)
    assert d.action == "hold" and d.say and "replayed row by row" in d.why


def test_a_lone_spike_after_a_logged_spike_no_policy_saw_is_held() -> None:
    """A loss spike not traced to its batch raises no decision; the guard's spike log has it,
    and a grad-norm spike 1 step after it is no lone spike (nanoGPT's resume seed 0: a skip at
    592, one step after a loss spike at 591 in a 600-step episode, left it worse than plain)."""
    logged = [{"step": 560, "samples": []}, {"step": 591, "samples": []},
              {"step": 592, "samples": []}]
    recovery = SimpleNamespace(lr_changes=LrChanges(), link=SimpleNamespace(spikes=lambda: logged))
    policy = make_policy("skip", default_act_on("skip"))
    d = _decide(policy, 592, _spike(592))
    assert d.action == "skip" and d.lone is not None  # lone, as far as the policy knows
    effects, row = effects_of(d, _stats(592), recovery=recovery, post=False, skips_in_row=0,
                              limit=10)
    assert row == 0 and [e.action for e in effects] == ["not_skipped"]
    assert "1 step(s) after the spike at step 591" in effects[0].detail
    # A bad batch's spike, or one further back than the window, leaves it lone.
    for before in ({"step": 591, "cause": "bad_batch"}, {"step": 592 - RECUR_STEPS - 1}):
        recovery.link.spikes = lambda before=before: [before, {"step": 592}]
        policy = make_policy("skip", default_act_on("skip"))
        d = _decide(policy, 592, _spike(592))
        effects, row = effects_of(d, _stats(592), recovery=recovery, post=False,
                                  skips_in_row=0, limit=10)
        assert row == 1 and isinstance(effects[0], Discard), before
