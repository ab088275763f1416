"""The `heal` policy's loss-spike side: act on what comes before a loss spike, then correct
the cause (issue 30; DESIGN.md section 5 "spikes").

On a small GPT at an aggressive LR (benchmarks/spiky_lm.py) the global grad norm jumps to 10-30x
its rolling mean one step before the loss jumps, while Adam's second moments (averaged over
~1/(1 - beta2) steps) still hold the small gradients of before: the update that step makes is
many times its usual size, and that update is the loss spike. Discarding the spiking update
after the fact (`skip`) leaves the moments as they became; so `Healer` acts on the precursor,
before the update:

- **Precursor**: the global grad norm above `HealConfig.ratio` x its rolling mean AND more than
  `HealConfig.z` rolling standard deviations above it (EMAs of the norms seen, fed the norm
  *after* clipping, so a spike does not raise the bar for the next one). Quiet-step cost: one
  EMA update and two float comparisons on the grad norm the acting guard reads anyway.
- **Act**: scale this step's gradients down to the rolling mean norm (what a typical step
  brings): the update goes ahead at its usual size, and the moments see a typical gradient.
- **Correct the cause**: `HealConfig.correct_after` precursors (clipped steps: two adjacent
  steps of one jump count as two) within `HealConfig.window` steps are taken to mean the
  setting itself is unstable, not one batch. Where the optimizer decays weights and
  the weight norm fell by > 10% while they came (decoupled weight decay shrinking the weights
  raises the effective step of every normalised layer: the product LR x WD sets it), the
  weight decay is cut (x `HealConfig.cut_factor`); otherwise the LR is (x `cut_factor`, on top
  of the scheduler's value, every step from then on). Each cut is an action with the run's own
  numbers; at most `HealConfig.max_cuts` cuts.
- **An LR jump** (`policy.lr_change`: the LR went up >= 3x in one step, a resume included): the
  cause is the jump, not the LR it went to. From the jump's step the LR is ramped back up from
  the pre-jump value, linearly over `HealConfig.ramp_steps` steps (x old/new at the jump,
  x 1 at its end, on top of the scheduler's value): the warm-up the schedule left out. Spikes
  during the ramp are clipped, never answered with an LR cut (the cut would halve the LR for
  the rest of the run for a cause the ramp already answers). Precursors that recur soon
  after the ramp ends (within `lr_change.FOLLOWS` steps) are the jump's target LR being
  unstable by itself: the LR is cut as for any recurrence, and the cause names the jump.
- **A bad batch** (a spike the detectors traced to its batch: `detect.bad_batch`) is clipped
  the same way, whatever heal's own thresholds say, and never counted as a precursor: the
  data was the cause, so the LR and the weight decay are left alone.

Every action is returned to the guard as a `Record` effect (report.json `actions`); `cost()` gives
`run.recovery.heal`: precursors, updates clipped, the cuts, the LR / WD factors now applied and
what drove the spikes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Protocol

import torch

from nanguard.config import HealConfig
from nanguard.detect.bad_batch import describe, is_bad_batch
from nanguard.policy.lr_change import FOLLOWS, Jump, LrChanges
from nanguard.recover.clip import ema_update
from nanguard.recover.effects import Record
from nanguard.watch.stats import StepStats

_SHRINK = 0.1
"""The weight norm must have fallen by more than this share for weight decay to be named."""


class _Link(Protocol):
    optimizer: torch.optim.Optimizer


class Healer:
    """Args:
    config: thresholds and the cause correction (`HealConfig`).
    link: the guard's recovery link (its optimizer).
    changes: the guard's LR changes (`policy.lr_change`), fed before the update.
    """

    def __init__(self, config: HealConfig, link: _Link, changes: LrChanges | None = None
                 ) -> None:
        self.config = config
        self.link = link
        self.changes = changes if changes is not None else LrChanges()
        self.ramp: Jump | None = None  # the jump being ramped over, until its ramp ends
        self.ramps: list[dict[str, Any]] = []  # every ramp (the report's `run.recovery.heal`)
        self.mean = 0.0
        self.var = 0.0
        self.count = 0
        self.lr_factor = 1.0
        self.wd_factor = 1.0
        self.precursors: deque[int] = deque()  # steps of the precursors within `window`
        self._ratios: deque[float] = deque()  # each one's grad norm / rolling mean (evidence)
        self.total = 0  # precursors acted on over the run
        self.total_bad = 0  # bad batches' updates clipped (never counted as precursors)
        self.bad_batches: deque[int] = deque(maxlen=100)  # steps of the latest bad batches
        self.cuts: list[dict[str, Any]] = []
        self.cause: str | None = None
        self._saved_lrs: list[float] | None = None
        # (step, weight norm) every 10 steps over the last 640: the decay's recent work
        self._pnorm: deque[tuple[int, float]] = deque(maxlen=64)
        self._records: list[Record] = []  # this step's actions, returned by `before_update`
        self.seconds = 0.0  # wall time spent acting (clipping, cutting): what it cost

    # -- per step

    def before_update(self, stats: StepStats) -> list[Record]:
        """Pre-hook, when the update goes ahead: clip a precursor, correct the cause when
        precursors recur, then apply the LR factor for this update (`after_update` undoes it,
        so the scheduler's own value is what it reads next). Returns the actions taken, for
        the guard to record."""
        norm = stats.grad_norm if not stats.nonfinite_grads else math.nan
        if math.isfinite(norm):
            if stats.alarms and is_bad_batch(stats.alarms):
                seen = self._clip_bad_batch(stats, norm)
            else:
                limit = self._precursor_limit(norm)
                seen = norm
                if limit is not None:
                    seen = self._clip(stats, norm, limit)
            self._update(seen)
        jump = self.changes.jump
        if jump is not None and jump.step == stats.step and self.config.ramp_steps > 0:
            self._start_ramp(jump)
        factor = self.lr_factor if self.ramp is None else self.lr_factor * self._ramp_factor(
            stats.step)
        if factor != 1.0:
            self._saved_lrs = [g["lr"] for g in self.link.optimizer.param_groups]
            for g in self.link.optimizer.param_groups:
                g["lr"] = g["lr"] * factor
        records, self._records = self._records, []
        return records

    def after_update(self) -> None:
        """Post-hook: the scheduler's (or user's) LR back."""
        if self._saved_lrs is None:
            return
        for g, lr in zip(self.link.optimizer.param_groups, self._saved_lrs, strict=True):
            g["lr"] = lr
        self._saved_lrs = None

    def _start_ramp(self, jump: Jump) -> None:
        self.ramp = jump
        n = self.config.ramp_steps
        self.ramps.append({"step": jump.step, "old_lr": jump.old, "new_lr": jump.new,
                           "factor": jump.factor, "steps": n})
        self._records.append(Record(
            jump.step, "lr_ramp",
            f"{jump.text()}: LR ramped back up from {jump.old:.3g}, linearly over {n} steps "
            f"(steps {jump.step}..{jump.step + n - 1}), instead of cut"))

    def _ramp_factor(self, step: int) -> float:
        """The ramp's factor on the scheduler's LR at `step`: old/new at the jump, growing
        linearly to 1 over `ramp_steps` steps (then the ramp ends)."""
        assert self.ramp is not None
        t, n = step - self.ramp.step, self.config.ramp_steps
        if t >= n or t < 0:
            self.ramp = None
            return 1.0
        low = 1.0 / self.ramp.factor
        return low + (1.0 - low) * t / n

    def _precursor_limit(self, norm: float) -> float | None:
        """The norm to clip to when `norm` is a precursor (the rolling mean), else None."""
        cfg = self.config
        if self.count < cfg.warmup_steps:
            return None
        std = math.sqrt(max(self.var, 0.0))
        if norm > cfg.ratio * self.mean and norm > self.mean + cfg.z * std and self.mean > 0:
            return self.mean
        return None

    def _clip(self, stats: StepStats, norm: float, limit: float) -> float:
        started = time.perf_counter()  # only on a precursor step: a quiet step pays nothing
        step, cfg = stats.step, self.config
        grads = [p.grad for g in self.link.optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        scale = limit / norm
        torch._foreach_mul_(grads, scale)
        self.total += 1
        self.precursors.append(step)
        self._ratios.append(norm / self.mean)
        while self.precursors and self.precursors[0] <= step - cfg.window:
            self.precursors.popleft()
            self._ratios.popleft()
        std = math.sqrt(max(self.var, 0.0))
        self._records.append(Record(
            step, "heal_clip",
            f"grad norm {norm:.3g} is {norm / self.mean:.1f}x its rolling mean {self.mean:.3g} "
            f"({(norm - self.mean) / std if std > 0 else math.inf:.1f} sigma): a loss spike's "
            f"precursor; gradients scaled by {scale:.3g} to the typical norm before the update "
            f"(no step lost)"))
        if len(self.precursors) >= cfg.correct_after and len(self.cuts) < cfg.max_cuts:
            self._correct(step)
        self.seconds += time.perf_counter() - started
        return limit

    def seed(self, norms: list[Any]) -> None:
        """Before the first step, from a resumed state saved without heal's own statistics (a
        guard under another policy): fold the grad norms of the steps before the save in, as
        if heal had seen them, so it acts from the first step after the resume."""
        if self.count:
            return
        for x in norms:
            if isinstance(x, (int, float)) and math.isfinite(x):
                self._update(float(x))

    def _clip_bad_batch(self, stats: StepStats, norm: float) -> float:
        """A spike the detectors traced to its batch (`detect.bad_batch`): scale its gradients
        down to the rolling mean like a precursor's, but it is no evidence against the LR or
        the weight decay: not counted towards a correction. Returns the norm the statistics
        see (the clipped one: a bad batch never raises the bar)."""
        self.bad_batches.append(stats.step)
        if not (self.count and self.mean > 0 and norm > self.mean):
            return norm
        started = time.perf_counter()
        grads = [p.grad for g in self.link.optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        scale = self.mean / norm
        torch._foreach_mul_(grads, scale)
        self.total_bad += 1
        self._records.append(Record(
            stats.step, "heal_clip",
            f"grad norm {norm:.3g} is {norm / self.mean:.1f}x its rolling mean "
            f"{self.mean:.3g}{describe(stats, stats.alarms)}; gradients scaled by "
            f"{scale:.3g} to the typical norm before the update (no step lost, no LR or "
            "weight decay cut: the data is the cause)"))
        self.seconds += time.perf_counter() - started
        return self.mean

    def _update(self, x: float) -> None:
        ema_update(self, x, self.config.ema, self.config.warmup_steps)

    def observe(self, stats: StepStats) -> None:
        """Post-hook, once the step is read: sample the weight norm (read for the detectors
        anyway) every 10 steps, the evidence that weight decay shrank the weights."""
        if stats.param_norms and stats.step % 10 == 0:
            pn = stats.param_norm
            if math.isfinite(pn):
                self._pnorm.append((stats.step, pn))

    # -- the cause

    def _correct(self, step: int) -> None:
        """Precursors recur: cut the weight decay when the evidence names LR x WD, else the LR;
        while an LR jump is ramped over, nothing (the jump is the cause, the ramp its answer)."""
        cfg = self.config
        if self.ramp is not None:
            self.cause = (f"{self.ramp.text()}; {len(self.precursors)} grad-norm spikes "
                          f"while the LR was ramped back up ({self._evidence()}; clipped, no cut)")
            self._forget()
            return
        groups = self.link.optimizer.param_groups
        lr = float(groups[0].get("lr", 0.0)) * self.lr_factor
        # The largest group's: a no-decay group (biases, norms) often comes first.
        wd = max(float(g.get("weight_decay", 0.0) or 0.0) for g in groups)
        # The largest sampled weight norm against the latest: shrinking by more than
        # `_SHRINK` is weight decay winning over the gradients (a few % is noise).
        first = max(self._pnorm, key=lambda s: s[1]) if self._pnorm else None
        last = self._pnorm[-1] if self._pnorm else None
        shrank = first is not None and last is not None and last[1] < (1 - _SHRINK) * first[1]
        n, span = len(self.precursors), step - self.precursors[0]
        seen = f" ({self._evidence()})"
        if wd > 0 and (cfg.correct == "wd" or (shrank and cfg.correct == "auto")):
            for g in groups:
                g["weight_decay"] = float(g.get("weight_decay", 0.0) or 0.0) * cfg.cut_factor
            self.wd_factor *= cfg.cut_factor
            fell = (f"the weight norm fell from {first[1]:.4g} (step {first[0]}) to "
                    f"{last[1]:.4g} (step {last[0]})" if shrank and first and last else
                    "the weight norm did not fall by > 10% (cut as configured: correct='wd')")
            self.cause = (
                f"LR x weight decay: lr {lr:.3g} x weight_decay {wd:.3g} = {lr * wd:.3g} per "
                f"step; {fell} while {n} grad-norm spikes came within {span} steps")
            what, detail = "wd_cut", (
                f"weight decay {wd:.3g} -> {wd * cfg.cut_factor:.3g} for the rest of the run: "
                f"{self.cause}")
        elif cfg.correct == "none":
            return
        else:
            self.lr_factor *= cfg.cut_factor
            self.cause = (f"the LR: lr {lr:.3g}" + (f" (weight decay {wd:.3g}, weight norm not "
                                                    "falling)" if wd > 0 else "")
                          + self._after_ramp(step)
                          + f"; {n} grad-norm spikes within {span} steps{seen}")
            what, detail = "lr_cut", (
                f"LR x{self.lr_factor:.3g} of the scheduler's from now on "
                f"({lr:.3g} -> {lr * cfg.cut_factor:.3g}): {self.cause}")
        self.cuts.append({"step": step, "action": what, "lr": lr, "weight_decay": wd})
        self._forget()  # the next cut needs fresh evidence
        self._records.append(Record(step, what, detail))

    def _forget(self) -> None:
        self.precursors.clear()
        self._ratios.clear()

    def _evidence(self) -> str:
        """The precursors behind a correction, as the person on call checks them against the
        run's grad norms: `steps 150 (6.1x its rolling mean), 250 (7.2x)`."""
        # (nan where a ratio is unknown: a state saved before they were kept)
        ratios = [*self._ratios, *[math.nan] * (len(self.precursors) - len(self._ratios))]
        parts = [f"{s} ({r:.1f}x{'' if i else ' its rolling mean'})" if math.isfinite(r)
                 else str(s) for i, (s, r) in enumerate(zip(self.precursors, ratios,
                                                            strict=False))]
        return "steps " + ", ".join(parts)

    def _after_ramp(self, step: int) -> str:
        """`, the LR a jump went to ...` when the spikes came soon after a ramp ended: the
        jump's target LR is unstable by itself, warm-up or not (the root cause the person on
        call wants named, not only the LR heal found)."""
        if not self.ramps:
            return ""
        r = self.ramps[-1]
        end = int(r["step"]) + int(r["steps"])
        if not end <= step <= end + FOLLOWS:
            return ""
        return (f", the LR the jump at step {r['step']} went to ({r['old_lr']:.3g} -> "
                f"{r['new_lr']:.3g}), at its full value for {step - end + 1} step(s) after "
                f"a {r['steps']}-step ramp")

    # -- report and state

    def cost(self) -> dict[str, Any]:
        """`run.recovery.heal`: what the policy did and why."""
        return {"precursors": self.total, "updates_clipped": self.total + self.total_bad,
                "steps_lost": 0, "bad_batches": list(self.bad_batches),
                "cuts": list(self.cuts), "lr_factor": self.lr_factor,
                "weight_decay_factor": self.wd_factor, "cause": self.cause,
                "lr_ramps": list(self.ramps), "seconds": round(self.seconds, 6)}

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "count": self.count,
                "lr_factor": self.lr_factor, "wd_factor": self.wd_factor, "total": self.total,
                "precursors": list(self.precursors), "precursor_ratios": list(self._ratios),
                "cuts": list(self.cuts),
                "cause": self.cause, "seconds": self.seconds, "total_bad": self.total_bad,
                "bad_batches": list(self.bad_batches), "ramps": list(self.ramps),
                "ramp": None if self.ramp is None else [self.ramp.step, self.ramp.old,
                                                        self.ramp.new, self.ramp.resumed]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.var, self.count = (float(state["mean"]), float(state["var"]),
                                           int(state["count"]))
        self.lr_factor, self.wd_factor = float(state["lr_factor"]), float(state["wd_factor"])
        self.total = int(state["total"])
        self.precursors = deque(int(s) for s in state["precursors"])
        ratios = [float(r) for r in state.get("precursor_ratios", ())]  # absent before them
        if len(ratios) != len(self.precursors):
            ratios = [math.nan] * len(self.precursors)
        self._ratios = deque(ratios)
        self.cuts = list(state["cuts"])
        self.cause = state["cause"]
        # Absent in states saved before them:
        self.seconds = float(state.get("seconds", 0.0))
        self.ramps = list(state.get("ramps", []))
        r = state.get("ramp")
        self.ramp = None if not r else Jump(int(r[0]), float(r[1]), float(r[2]), bool(r[3]))
        self.total_bad = int(state.get("total_bad", 0))  # absent before bad batches
        self.bad_batches = deque((int(s) for s in state.get("bad_batches", ())), maxlen=100)
