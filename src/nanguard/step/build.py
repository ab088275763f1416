"""How a step pipeline is put together: its settings (`settle_config`) and its parts (`build`).

Nothing here runs during training. `build` makes every part once and returns them as `Parts`;
no part is assigned from outside afterwards. Its order matters in two places: the run store is
opened before anything touches the model (an unwritable folder must leave it unhooked), and the
saturation probe's and the replica check's optimizer hooks are registered here, before the
pipeline registers its own (the probe disarms before the pipeline's pre-hook, and any replay,
runs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nanguard._version import __version__
from nanguard.config import GuardConfig
from nanguard.detect import Alarm, default_detectors
from nanguard.detect.detectors import Detector
from nanguard.detect.gate import QuietGate
from nanguard.detect.objective import Objective
from nanguard.policy import Policy, device_skip, make_policy
from nanguard.record.events import Events, Listener
from nanguard.record.runlog import RunLog
from nanguard.record.store import NullStore, open_store
from nanguard.recover.effects import Effect
from nanguard.recover.link import WeakLink
from nanguard.recover.recovery import PerStep, Recovery
from nanguard.runtime import distributed
from nanguard.show import live
from nanguard.step.state import StepState
from nanguard.watch import loads, replicas, rng, saturation
from nanguard.watch.activations import ActivationProbe, dtype_max
from nanguard.watch.batch import BatchProbe
from nanguard.watch.lane import QuietLane
from nanguard.watch.norms import local
from nanguard.watch.probe import StepProbe, watched_buffers
from nanguard.watch.replicas import ReplicaCheck
from nanguard.watch.saturation import SaturationProbe
from nanguard.watch.step import StepWatch

__all__ = ["Parts", "build", "param_table", "settle_config"]


class Host(Protocol):
    """What the parts are built around and report to: the step pipeline (recovery's link,
    the saturation probe and the replica check hold it weakly)."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    replay: Callable[[Any], torch.Tensor] | None
    state: StepState
    error: dict[str, Any] | None

    @property
    def step(self) -> int: ...

    @property
    def params(self) -> list[torch.Tensor]: ...

    @property
    def param_names(self) -> list[str]: ...

    @property
    def closed(self) -> bool: ...

    @property
    def spikes(self) -> list[dict[str, Any]]: ...

    def apply(self, effects: list[Effect]) -> None: ...

    def record_alarm(self, alarm: Alarm) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parts:
    """The pipeline's parts, made once by `build` (frozen: none is replaced later)."""

    store: NullStore
    """run.db and the run folder (a `NullStore` records nothing)."""
    events: Events
    """Every alarm, action and finding as it happens (the live log, callbacks, exporters)."""
    log: RunLog
    """The one writer of alarms, actions, the finding and spikes into the record."""
    probe: StepProbe
    """Gradient, parameter, optimizer-state and buffer norms."""
    batch_probe: BatchProbe
    act_probe: ActivationProbe | None
    """Per-module activation abs-max (None unless `WatchConfig.activations`)."""
    steps: StepWatch
    """Each step's packets, read back as `StepStats`."""
    buffer_names: list[str]
    detectors: list[Detector]
    """Pre-update ones first (`detect.default_detectors`)."""
    gate: QuietGate
    """In front of the detectors: a step none of them could alarm on only updates state."""
    objective: Objective
    """Is the loss a stationary series (on-policy RL, a GAN: no)? Its trend alarms follow."""
    lane: QuietLane | None
    """The quiet lane, where this configuration lets a step take it (`watch.lane`)."""
    recovery: Recovery
    recovery_steps: PerStep
    """What a step runs of `recovery` under this configuration (None: left out of the step)."""
    policy: Policy
    saturation: SaturationProbe | None
    """Armed one step in `saturation_every`; None: off."""
    replicas: ReplicaCheck | None
    """Replica agreement under DDP; None: off."""
    cross_rank: bool
    """The ranks re-run an alarmed rank's batch on a peer (decided once: no call per step)."""


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


def param_table(model: nn.Module, optimizer: torch.optim.Optimizer
                ) -> tuple[list[torch.Tensor], list[str], list[int]]:
    """The parameters as the optimizer holds them, their names in the model and where each
    sits in the model's module order (`StepState.param_order`)."""
    named = list(model.named_parameters())
    names = {id(p): name for name, p in named}
    order = {id(p): k for k, (_, p) in enumerate(named)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return (params, [names.get(id(p), f"param{i}") for i, p in enumerate(params)],
            [order.get(id(p), len(named) + i) for i, p in enumerate(params)])


def build(host: Host, *, scheduler: Any, scaler: Any, on_alarm: Listener | None,
          on_action: Listener | None, on_finding: Listener | None) -> Parts:
    """Every part of `host`'s pipeline, in the order the module docstring gives; writes
    run.db's first rows (versions, policy, classes, parameters, the RNG states step 0 starts
    from). Raises ValueError before touching the model when the run folder cannot be used."""
    cfg, model, state = host.config, host.model, host.state
    store = open_store(cfg.record.out, cfg.record.if_exists)
    events = Events(quiet_steps=max(cfg.detect.lead_window, 10),
                    summary_follows=cfg.record.summary)
    log = RunLog(store, events)
    live.ensure_handler()
    events.add(live.log_event)
    for fn, kind in ((on_alarm, "alarm"), (on_action, "action"), (on_finding, "finding")):
        if fn is not None:
            events.subscribe(fn, only=kind)

    buffer_names, buffers = watched_buffers(model)
    probe = StepProbe(state.params, host.optimizer, buffers)
    act_probe = (ActivationProbe(model, attention=cfg.watch.attention)
                 if cfg.watch.activations else None)
    batch_probe = BatchProbe()

    def loaded_finding(step: int, names: list[str], flags: list[float]) -> None:
        # A step carrying loaded-state flags was decoded: a non-finite value there is the
        # first finding, said at once (phase `checkpoint`: where it came from).
        if log.finding is not None:
            return
        found = loads.finding(step, names, flags, state.load_site or loads.last_site())
        if found is not None:
            found["rank"] = distributed.rank()
            log.set_finding(found, announce=True)

    steps = StepWatch(probe, batch_probe, act_probe, cfg.watch, on_loaded=loaded_finding)
    act_limit = None
    if cfg.watch.activations:  # the overflow limit of the narrowest floating dtype trained
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        act_limit = min((dtype_max(d) for d in dtypes), default=None)
    detectors = default_detectors(cfg.detect, act_limit)
    cross_rank = (host.replay is not None and cfg.detect.cross_rank_rerun
                  and isinstance(model, DistributedDataParallel) and distributed.active())

    recovery = Recovery(WeakLink(host), scheduler=scheduler, scaler=scaler)
    policy = make_policy(cfg.policy, cfg.acting_on, cfg.recover.max_consecutive_skips)
    store.write_meta(version=__version__, policy=cfg.policy, model=type(model).__name__,
                     optimizer=type(host.optimizer).__name__, started=time.time())
    store.write_params([(n, tuple(p.shape), p.numel())
                        for n, p in zip(state.param_names, state.params, strict=True)])
    store.write_rng(0, rng.dumps(state.step_rng))
    return Parts(
        store=store, events=events, log=log, probe=probe, batch_probe=batch_probe,
        act_probe=act_probe, steps=steps, buffer_names=buffer_names, detectors=detectors,
        gate=_gate(detectors, cfg), objective=Objective(cfg.detect.objective, detectors, model),
        lane=_lane(host, steps, cfg, cross_rank, act_probe), recovery=recovery,
        recovery_steps=recovery.per_step(), policy=policy,
        # Their hooks before the pipeline's own (see the module docstring).
        saturation=saturation.attach(host, cfg.detect.saturation_every),
        replicas=replicas.attach(host, cfg.detect.replica_every,
                                 rides=cfg.policy != "observe"),
        cross_rank=cross_rank)


def _gate(detectors: list[Detector], cfg: GuardConfig) -> QuietGate:
    """The quiet gate in front of the detectors (off with `DetectConfig.quiet_gate=False`)."""
    gate = QuietGate(detectors)
    gate.enabled = gate.enabled and cfg.detect.quiet_gate
    return gate


def _lane(host: Host, steps: StepWatch, cfg: GuardConfig, cross_rank: bool,
          act_probe: ActivationProbe | None) -> QuietLane | None:
    """The quiet lane, where this guard's configuration lets a step take it (`watch.lane`: no
    clipping, no cross-rank agreement, no activation watch, a read every step, local
    parameters, no `skip` the device could decide); per step the pipeline checks the rest."""
    params = host.params
    if (not cfg.watch.quiet_lane or cfg.clip is not None or cross_rank or act_probe is not None
            or cfg.watch.read_every != 1 or not params
            or (cfg.policy == "skip" and set(cfg.acting_on) == {"nonfinite"}
                and device_skip.supports(host.optimizer))
            or any(local(p) is not p for p in params)):  # a sharded (DTensor) one
        return None
    return QuietLane(steps, cfg.watch.update_ratio_every)
