"""The guards `nanguard run` gives the optimizers it finds (run/discovery.py calls
`Guards.attach` the first time an optimizer steps, or at the end of a run for one that never
did): the run's policy and config, except where an optimizer cannot take them, the script's
`RunFacts` shared by all of them, their rollback group, and the in-process replay of the
recorded step (run/watched.py).

A guard that cannot be built leaves its error on the `Watched` (`error`) and the script runs
on unwatched by it: the runner's hooks never stop the training.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanguard.config import GuardConfig
from nanguard.guard import Guard
from nanguard.pinpoint.recorded import NotReplayable
from nanguard.run import resume_state
from nanguard.run.chains import replaced
from nanguard.run.script_flags import clip_from_argv
from nanguard.run.watched import Watched, as_model, holds_compiled, replay_recorded
from nanguard.step.state import RunFacts

__all__ = ["Guards", "give_guard"]


class _Coupling:
    """The rollback group of one script's guards (any weak-referenceable object will do)."""


class Guards:
    """The optimizers a script has stepped, each with its guard (`watched`, in the order
    found).

    Args:
        folder_for: gives the run folder of the n-th optimizer found (called when it is found).
        policy: the guards' policy.
        config: the guards' config.
        preflight: the `LivePreflight` whose verdict goes into the `RunFacts`, or None.
    """

    def __init__(self, folder_for: Callable[[int], Path], *, policy: str, config: GuardConfig,
                 preflight: Any = None) -> None:
        self.folder_for = folder_for
        self.policy = policy
        self.config = config
        self.preflight = preflight
        self.watched: list[Watched] = []
        self._by_opt: dict[int, Watched] = {}
        self._coupling = _Coupling()
        self.script_clip: float | None = None
        """The `max_norm` the script last passed to `clip_grad_norm_` (0: clipping off)."""
        self.facts: RunFacts | None = None
        """How the script runs, given to each of its guards (`Guard(facts=...)`): one object
        made at the first guard, when `sys.argv` is the script's; the clip the script passes
        to `clip_grad_norm_` later is noted there too (the diagnosis reads it at the end)."""

    def get(self, opt_id: int) -> Watched | None:
        """The `Watched` of the optimizer with this `id` (check `optimizer is` on it: an id
        may have been reused by a new optimizer)."""
        return self._by_opt.get(opt_id)

    def note_clip(self, max_norm: float) -> None:
        """The script calls `clip_grad_norm_` with `max_norm`."""
        self.script_clip = max_norm
        if self.facts is not None:
            self.facts.script_clip = max_norm

    def attach(self, optimizer: torch.optim.Optimizer, roots: list[Any], *, scaler: Any,
               alive: Callable[[], bool]) -> Watched:
        """A guard for `optimizer`, whose parameters `roots` hold (`give_guard`)."""
        index = len(self.watched)
        w = Watched(index=index, optimizer=optimizer, guard=None,
                    model=as_model(roots, optimizer), folder=self.folder_for(index),
                    roots=roots)
        give_guard(w, policy=self.policy, config=self.config, facts=self._facts,
                   scaler=scaler, coupling=self._coupling, alive=alive)
        before = replaced(self.watched, optimizer)
        if before is not None and w.guard is not None and before.guard is not None:
            # A new optimizer over the parameters of an earlier one (one every epoch): the
            # same training goes on, and its detectors keep their baselines.
            w.guard.take_baselines(before.guard)
        elif w.guard is not None:
            # A script that resumed from a checkpoint saved under `nanguard run`: the guard
            # goes on from the state saved with it (run/resume_state.py).
            resume_state.restore(w)
        self.watched.append(w)
        self._by_opt[id(optimizer)] = w
        if len(self.watched) > 1:  # several parts: each one's live lines say which
            for part in self.watched:
                if part.guard is not None:
                    part.guard.events.name_part(part.name)
        return w

    def _facts(self) -> RunFacts:
        """The script's `RunFacts` (made at its first guard): fixes are phrased as `nanguard
        run` flags; the clip is the script's own, or 0 when its flag turned clipping off (it
        then never calls `clip_grad_norm_`); the preflight's verdict once it ran."""
        if self.facts is None:
            off = 0.0 if clip_from_argv(sys.argv[1:]) == 0 else None
            self.facts = RunFacts(
                entry="run", script_clip=self.script_clip if self.script_clip is not None
                else off)
        if self.preflight is not None and self.preflight.result is not None:
            self.facts.preflight = self.preflight.result
        return self.facts


def give_guard(w: Watched, *, policy: str, config: GuardConfig, facts: Callable[[], RunFacts],
               scaler: Any, coupling: object, alive: Callable[[], bool]) -> None:
    """Build `w`'s guard (`w.guard`; `w.error` when it cannot be built).

    Args:
        w: the optimizer found, its model and run folder already chosen.
        policy: the run's policy; a hand-written update is watched with `observe` (`w.note`
            says so).
        config: the run's guard config; activation hooks are left off a compiled model.
        facts: gives the script's `RunFacts`, shared by all its guards.
        scaler: the GradScaler serving this optimizer, or None.
        coupling: the rollback group of the script's guards.
        alive: whether the run still goes on (a replay after it raises `NotReplayable`).
    """
    if w.manual and policy in ("skip", "rollback", "heal"):
        # Discarding an update means taking the gradients away from the optimizer; a
        # hand-written update would then fail on `p.grad is None`. Watch only.
        w.note = (f"--policy {policy} cannot undo hand-written updates (no optimizer "
                  "steps in this script): watched with observe")
        policy = "observe"
    if config.watch.activations and any(holds_compiled(r) for r in w.roots):
        # Hooks inside a compiled region would cost graph breaks: not hooked.
        config = dataclasses.replace(
            config, watch=dataclasses.replace(config.watch, activations=False))
    assert w.model is not None, "as_model gives every Watched its model"
    model = w.model
    try:

        def replay(batch: Any) -> torch.Tensor:
            if not alive():
                raise NotReplayable("the run is over")
            return replay_recorded(w, batch)

        w.guard = Guard(model, w.optimizer, policy=policy, out=str(w.folder), config=config,
                        replay=replay, scaler=scaler, facts=facts())
        # The epilogue may re-run the failing step: findings wait for it (runner.py).
        w.guard.events.hold_findings()
        # A script's optimizers train coupled models (a GAN): they roll back together.
        w.guard.recovery.couple(coupling)
        # How to run it again (`nanguard replay`): sys.argv is the script's here.
        w.guard.store.write_meta(script=os.path.abspath(sys.argv[0]), argv=sys.argv[1:],
                                 cwd=os.getcwd(), optimizers=w.index + 1)
    except Exception as exc:  # noqa: BLE001 - the script must run on regardless
        w.error = f"{type(exc).__name__}: {exc}"
