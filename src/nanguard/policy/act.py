"""From a policy's `Decision` to the effects the guard applies (`recover.effects`).

The policy stage (`policy.stage`) says what to do with a step; this turns that into what
happens: discard the update, roll back (through `Recovery`, which restores the model itself
and returns its records), give up, or stop. Nothing here touches the guard: the guard applies
the returned effects in order (a `Stop` last).
"""

from __future__ import annotations

from nanguard.policy.recurrence import after_jump, after_spikes
from nanguard.policy.stage import Decision, Verdict
from nanguard.recover.effects import Discard, Effect, Record, Stop
from nanguard.recover.recovery import Recovery
from nanguard.recover.skips import batch_note
from nanguard.watch.stats import StepStats


def lone_held(step: int, recovery: Recovery) -> str | None:
    """Why the update of a spike at `step` the policy took for lone goes ahead after all
    (None: it is discarded). A lone spike right after an LR jump is the jump's, one a few steps
    after a spike no policy was asked about (a loss spike) a recurrence (`policy.recurrence`):
    the policy sees neither (the guard's `LrChanges`, its spike log), so they are weighed
    here."""
    return (after_jump(step, recovery.lr_changes.jump)
            or after_spikes(step, recovery.link.spikes()))


def keeps_update(verdict: Verdict, step: int, recovery: Recovery) -> bool:
    """Whether the policy's `verdict` on the spike of `step` (`Policy.verdict`) lets its update
    go ahead: under torch.distributed every rank agrees on it first (`step.acting`)."""
    return verdict == "hold" or (verdict == "lone" and lone_held(step, recovery) is not None)


def effects_of(d: Decision, stats: StepStats, *, recovery: Recovery, post: bool,
               skips_in_row: int, limit: int) -> tuple[list[Effect], int]:
    """The effects of decision `d` on step `stats`, and the count of consecutive discarded
    updates after it (`skips_in_row` before; `limit`: `recover.max_consecutive_skips`).

    Runs in the step hook that decided (pre: before the update; `post`: after it). A rollback
    has restored the model by the time this returns; the rest happens when the guard applies
    the effects."""
    if d.lone is not None and (held := lone_held(stats.step, recovery)):
        say, d.lone.said = not d.lone.said, True
        return ([Record(stats.step, "not_skipped", held)] if say else []), skips_in_row
    if d.action == "hold":
        # A spike of a recurring instability: the update goes ahead; said once per instability,
        # naming the LR jump when one came just before (the more specific cause).
        if not d.say:
            return [], skips_in_row
        why = after_jump(stats.step, recovery.lr_changes.jump) or d.why
        return [Record(stats.step, "not_skipped", why)], skips_in_row
    if d.action == "skip":
        return [Discard(stats), Record(stats.step, "skip", f"update discarded ({d.why})"
                                       f"{batch_note(stats)}")], skips_in_row + 1
    if d.action == "discard_spike":
        # The spike was seen before its update: no rollback, no LR change, nothing counted.
        return [Discard(stats), Record(stats.step, "skip", (
            f"update discarded ({d.why}): the state before it is still good, no rollback "
            f"needed{batch_note(stats)}"))], skips_in_row
    if d.action == "rollback":
        return recovery.rollback(stats, d.why, post), skips_in_row
    if d.action == "escalate":
        rolled = recovery.escalate(stats, f"{limit} skips in a row ({d.why})", post)
        if rolled is not None:
            return rolled, 0  # recover.skip_escalation="rollback" rolled back
        detail = (f"{skips_in_row} updates discarded in a row and the next is "
                  f"bad too ({d.why}); skipping does not heal this run: stopped")
        return [Record(stats.step, "give_up", detail), Stop(stats, detail)], skips_in_row
    if d.action == "cannot_skip":
        # The update itself produced the non-finite value; undoing it needs a saved copy,
        # which is the `rollback` policy's job. Record that it could not be skipped.
        rolled = recovery.escalate(stats, d.why, post)  # skip_escalation="rollback"
        if rolled is not None:
            return rolled, skips_in_row
        return [Record(stats.step, "none", f"non-finite after the update ({d.why}); cannot "
                       "skip")], skips_in_row
    if d.action == "raise":
        return [Record(stats.step, "raise", f"stopped ({d.why})"), Stop(stats, d.why)], \
            skips_in_row
    return [], skips_in_row


def device_skip_effects(stats: StepStats, *, skips_in_row: int, limit: int
                        ) -> tuple[list[Effect], int]:
    """A fused optimizer discarded step `stats` on the device (its `found_inf` flag, read a
    step late on a GPU): a `skip` action; too many in a row stop the run, as the host-side
    `skip` does. Returns the effects and the new count of consecutive skips."""
    stats.skipped = True
    skips_in_row += 1
    why = ", ".join(stats.seal()) or "non-finite gradient norm"
    effects: list[Effect] = [Record(stats.step, "skip",
                                    f"update discarded on the device ({why}){batch_note(stats)}")]
    if skips_in_row > limit:
        detail = (f"{limit} updates discarded in a row and the next was bad too ({why}); "
                  "skipping does not heal this run: stopped")
        effects += [Record(stats.step, "give_up", detail), Stop(stats, detail)]
    return effects, skips_in_row
