"""Which steps measure the sampled signals, and what the report says about them.

DESIGN section 8 splits what a step measures in two. Every step, under every policy: the loss,
the gradients' norms (per parameter and global) and finiteness, the parameters' and buffers'
norms and finiteness after the update, the batch's finiteness. These catch a non-finite value
where it appears (data, forward, loss, backward, optimizer: a NaN entering the optimizer state
reaches the parameters at the same update) and a gradient spike at its step.

Sampled: the optimizer-state norms (momentum, Adam's moments) every `WatchConfig.sample_every`
steps, the update ratio every `update_ratio_every` (it needs a copy of the parameters before
the update) and the activations every `activations_every` when watched. The state is also
measured:

- on every step of an alarm episode: from the step after an alarm was read until
  `sample_every` steps without one have passed (the cascade and forecast detectors see the
  first moment step by step while something is wrong);
- on the step after each checkpoint save the guard sees (its `state_dict()`);
- on the first step whose parameters or buffers came back non-finite, while they are still
  those measured (the finding names the state tensors that went bad with them, as before
  sampling; the steps after it are an alarm episode's);
- at close, when the last step did not measure it: a state gone non-finite since the last
  sample (an `exp_avg_sq` overflowing to inf zeroes its updates and leaves the parameters
  finite) is then a finding at the last step.

`Sampler` decides per step (on the quiet path, a comparison with its `due` step and a look at
the newest step's alarms, no call) and counts why;
`Sampler.report` is report.json's `sampling`.
"""

from __future__ import annotations

from typing import Any

from nanguard.config import WatchConfig
from nanguard.watch.stats import StepStats

__all__ = ["EVERY_STEP", "Sampler"]

EVERY_STEP = ("loss", "grad_norms", "param_norms", "buffer_norms", "batch")
"""What every step measures, whatever `sample_every` is (finiteness included)."""

_NEVER = -(10**18)


class Sampler:
    """The sampling schedule of one guard's watch (see the module docstring).

    Args:
        config: the guard's watch settings (`sample_every`, `update_ratio_every`,
            `activations`, `activations_every`).
    """

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.every = config.sample_every
        self.last: StepStats | None = None
        """The newest step read (its `alarms` are filled by the detectors after the read)."""
        self.last_state = True
        """Whether that step measured the optimizer state."""
        self.due = 0
        """The next step that samples unless an alarm comes first: `wants` is True from it
        on (a step before it asks `state` only when the newest step read has alarms)."""
        self._alarm_step = _NEVER
        self._save = False
        self.counts = {"stride": 0, "alarm": 0, "save": 0, "nonfinite": 0, "close": 0}
        """Steps that measured the state, by why (a step counts once, under its first
        reason in this order)."""

    def wants(self, step: int) -> bool:
        """Runs in the step post-hook, before the post-update pass: whether it measures the
        optimizer state at `step`. The quiet lane makes this test inline (no call)."""
        last = self.last
        return (step >= self.due or (last is not None and bool(last.alarms))) and self.state(step)

    def state(self, step: int) -> bool:
        """`wants`, decided: a step at or past `due`, or after a step read with alarms."""
        last = self.last
        if last is not None and last.alarms and last.step > self._alarm_step:
            self._alarm_step = last.step
        every = self.every
        in_episode = step - self._alarm_step <= every
        why = ("stride" if step % every == 0 else "alarm" if in_episode
               else "save" if self._save else None)
        if why is not None:
            self.counts[why] += 1
            self._save = False
        # The next step to sample: the next multiple of `every`, or the next one while an
        # episode is open (a later alarm keeps it open).
        self.due = step + 1 if step + 1 - self._alarm_step <= every else (step // every + 1) * every
        return why is not None

    def took(self, stats: StepStats, state: bool) -> None:
        """Runs after each step's read: `stats` is the newest step, `state` whether it holds
        the optimizer state."""
        self.last, self.last_state = stats, state

    def saw_save(self) -> None:
        """A checkpoint save (the guard's `state_dict()`): the next step measures the state."""
        self._save = True
        self.due = 0

    def state_dict(self) -> dict[str, Any]:
        """The schedule where it stands (an alarm episode still open after a resume goes on
        sampling as it would have), and the counts so far."""
        return {"alarm_step": self._alarm_step, "due": self.due, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Put back what `state_dict` returned (None: a state saved before sampling)."""
        if not state:
            return
        self._alarm_step = int(state["alarm_step"])
        self.due = int(state["due"])
        self.counts.update(state["counts"])

    def report(self) -> dict[str, Any]:
        """report.json's `sampling`: the stride of each sampled signal (None: not measured),
        what every step measures, and how many steps measured the state, by why."""
        c = self.config
        return {
            "every": self.every,
            "signals": {"optimizer_state": self.every,
                        "update_ratio": c.update_ratio_every or None,
                        "activations": c.activations_every if c.activations else None},
            "every_step": list(EVERY_STEP),
            "state_steps": sum(self.counts.values()),
            "state_why": dict(self.counts),
        }
