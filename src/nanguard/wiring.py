"""How a `Guard` is put together: its settings, stages, starting state and hooks.

`Guard.__init__` calls these in order, once; nothing here runs during training. The order
matters in two places: the run store is opened before anything touches the model (an
unwritable folder must leave it unhooked; the Guard does that first), and the guard's own
optimizer hooks are registered after those of the saturation probe and the replica check
(the probe disarms before the guard's pre-hook, and any replay, runs).

Each function sets the attributes `StepPath` declares, or returns what only the Guard holds;
none imports the Guard (it imports this module).
"""

from __future__ import annotations

import atexit
import dataclasses
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from nanguard._version import __version__
from nanguard.config import GuardConfig
from nanguard.detect import default_detectors
from nanguard.detect.detectors import Detector
from nanguard.detect.gate import QuietGate
from nanguard.detect.objective import Objective
from nanguard.pinpoint.baseline import GradBaseline
from nanguard.record.events import Events, Listener
from nanguard.record.runlog import RunLog
from nanguard.record.store import NullStore
from nanguard.recover.verdict import LossWatch
from nanguard.show import live
from nanguard.step_path import StepPath
from nanguard.watch import rng
from nanguard.watch.activations import ActivationProbe, dtype_max
from nanguard.watch.batch import BatchProbe
from nanguard.watch.stats import StepProbe, watched_buffers
from nanguard.watch.step import StepWatch


def settle_config(model: nn.Module, optimizer: torch.optim.Optimizer,
                  config: GuardConfig | None, *, policy: str | None, out: str | Path | None,
                  activations: bool | None) -> GuardConfig:
    """The guard's settings: a copy of `config` (or the defaults) with the keyword arguments
    of `Guard` laid over it, validated. Raises ValueError, saying what to pass, on a model or
    optimizer of the wrong type or settings that cannot work; nothing is touched before."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; "
            "pass the model you train"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "pass the optimizer whose step() trains the model"
        )
    # A copy: the user's config object may be shared by several guards.
    cfg = dataclasses.replace(config) if config else GuardConfig()
    if policy is not None:
        cfg.policy = policy
    if activations is not None:
        cfg.watch = dataclasses.replace(cfg.watch, activations=activations)
    if out is not None:
        cfg.record = dataclasses.replace(cfg.record, out=str(out))
    cfg.validate()
    return cfg


def watch_stage(guard: StepPath) -> list[Detector]:
    """The watch and detect stages: the parameters as the optimizer holds them, the probes of
    each step's packet (activations only when asked), the detectors by phase and the quiet
    gate in front of them. Returns the detectors. Registers the activation probe's forward
    hooks on the model (the run store is open by now)."""
    cfg, model = guard.config, guard.model
    guard.params, guard.param_names, guard._param_order = [], [], []
    guard.buffer_names, buffers = watched_buffers(model)
    guard.probe = StepProbe(guard.params, guard.optimizer, buffers)
    guard._sync_params()  # the three lists from the optimizer's groups (the probe's too)
    guard.act_probe = (ActivationProbe(model, attention=cfg.watch.attention)
                       if cfg.watch.activations else None)
    guard.batch_probe = BatchProbe()
    guard.steps = StepWatch(guard.probe, guard.batch_probe, guard.act_probe, cfg.watch,
                            on_loaded=guard._loaded_finding)
    act_limit = None
    if cfg.watch.activations:  # the overflow limit of the narrowest floating dtype trained
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        act_limit = min((dtype_max(d) for d in dtypes), default=None)
    detectors = default_detectors(cfg.detect, act_limit)
    pre = [d for d in detectors if d.phase == "pre"]
    post = [d for d in detectors if d.phase == "post"]
    guard._by_phase = {"pre": pre, "post": post, "both": pre + post}
    guard._gate = QuietGate(detectors)  # steps no detector could alarm on: state updates only
    # Is the loss a stationary series (on-policy RL, a GAN: no)? Its trend alarms follow.
    guard._objective = Objective(cfg.detect.objective, detectors, model)
    guard._rerun_every = cfg.detect.rerun_every
    return detectors


def step_state(guard: StepPath) -> None:
    """What the step path keeps between steps, as before the first one: no step, nothing
    pending or in flight, the RNG states the first step starts from, the loaded state to be
    checked once before the first update, and whether the ranks re-run each other's batches
    (decided once here: no call on the quiet path)."""
    guard.step = 0
    guard._last_stats = None
    guard._grad_baseline = GradBaseline()  # per-parameter EMA of healthy grad norms
    guard._loss = None
    guard._clip_norm, guard._clips = None, {}  # the script's own clip norms (note_clip_norm)
    guard._pending = []
    guard._current = None
    guard._stashed_grads = None
    guard._step_rng = rng.capture()
    guard._check_loaded = True  # state loaded before the first update: checked once
    guard._load_site = None
    guard._watch_calls = 0  # watch(loss=...) calls since the last optimizer step
    guard._skips_in_row = 0  # consecutive updates the `skip` policy discarded
    guard._losses = LossWatch()  # the loss level before any trouble, and since
    guard._loss_after = None  # a loaded state's loss at save, for the steps after the resume
    guard._in_hook = None  # `pre` / `post` while a step hook runs
    guard._agreed = False  # that hook took part in its cross-rank agreement
    guard._rerun_rank = None  # the agreement asked for a cross-rank re-run
    guard._cross_rank = guard._crosses_ranks()


def record_stage(store: NullStore, cfg: GuardConfig, *, on_alarm: Listener | None,
                 on_action: Listener | None, on_finding: Listener | None
                 ) -> tuple[Events, RunLog]:
    """The event stream (the live log first, then the user's callbacks) and the run log that
    records into `store` and announces there."""
    events = Events(quiet_steps=max(cfg.detect.lead_window, 10))
    events.summary_follows = cfg.record.summary
    log = RunLog(store, events)
    live.ensure_handler()
    events.add(live.log_event)
    for fn, kind in ((on_alarm, "alarm"), (on_action, "action"), (on_finding, "finding")):
        if fn is not None:
            events.subscribe(fn, only=kind)
    return events, log


def write_start(guard: StepPath) -> None:
    """run.db's first rows: what runs (versions, policy, classes, start time), the parameters
    and the RNG states step 0 starts from."""
    cfg = guard.config
    guard.store.write_meta(
        version=__version__, policy=cfg.policy, model=type(guard.model).__name__,
        optimizer=type(guard.optimizer).__name__, started=time.time(),
    )
    guard._write_params()
    guard.store.write_rng(0, rng.dumps(guard._step_rng))


def hooks(guard: StepPath, hook_optimizer: bool) -> list[RemovableHandle]:
    """The guard's hooks: the optimizer's step pre- and post-hooks (unless a framework adapter
    marks the step boundary itself) and the load_state_dict post-hooks of the model and the
    optimizer (loaded values are checked before the next update). Returns their handles."""
    optimizer = guard.optimizer
    return [
        *([optimizer.register_step_pre_hook(guard._pre_hook),
           optimizer.register_step_post_hook(guard._post_hook)] if hook_optimizer else []),
        guard.model.register_load_state_dict_post_hook(guard._on_load),
        optimizer.register_load_state_dict_post_hook(guard._on_load),
    ]


def close_at_exit(guard: StepPath) -> Callable[[], None]:
    """Close `guard` at interpreter exit if the script never did; returns the registered
    function (`close` unregisters it). Holds the guard weakly: a dropped guard is not kept."""
    ref = weakref.ref(guard)

    def closer() -> None:
        if (g := ref()) is not None:
            g.close()

    atexit.register(closer)
    return closer
