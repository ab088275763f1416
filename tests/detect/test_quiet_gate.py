"""The quiet gate against the full detector pass: the same alarms, the same detector state.

Each trace is replayed twice, from fresh default detectors: once through every detector's
`check` (the full pass, the reference), once through the gate, where each detector takes its
quiet update on the steps it cannot alarm on and its `check` on the others. The traces are
generated (healthy LR schedules with warm-up, spikes, cascades to overflow and NaN, slow
drifts, NaN episodes, sustained loss jumps, vanishing gradients, sampled activations,
optimizers without momentum) under many detector configurations, read in one pass or in a pre
and a post phase, and resumed from a JSON `state_dict` halfway. Alarms compare by kind,
signal, step, repr of the value, message and cause; states by their JSON text (signed zeros
and NaN included).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from typing import Any

import pytest

from nanguard.config import DetectConfig
from nanguard.detect import Detector, SpikeDetector, VanishingDetector, default_detectors
from nanguard.detect.gate import QuietGate
from nanguard.watch.stats import StepStats

Trace = list[dict[str, Any]]


def _trace(seed: int) -> Trace:
    """A run's per-step magnitudes; each seed mixes its own episodes."""
    r = random.Random(seed)
    n = r.choice([60, 250, 400])
    g, loss, act, mom, param = (r.uniform(0.1, 5), r.uniform(0.5, 5), r.uniform(1, 20),
                                r.uniform(0.1, 2), r.uniform(1, 50))
    noise = r.choice([0.02, 0.1, 0.3])
    sampled = r.choice([1, 1, 4])  # activations measured every N steps
    momentum = r.random() < 0.7
    warm = r.choice([0, 10, 50])  # LR warm-up steps: gradients climb with the LR
    events: list[tuple[str, int]] = []
    for _ in range(r.randint(0, 4)):
        events.append((r.choice(["spike", "cascade", "drift", "nan", "jump", "vanish",
                                 "zero", "early"]), r.randrange(n)))
    out: Trace = []
    cascade_at = {s: k for k, s in events if k == "cascade"}
    growing = 0.0
    nan_left = 0
    for step in range(n):
        lr_scale = min(1.0, (step + 1) / warm) if warm else 1.0
        lr_scale *= 0.5 * (1 + math.cos(math.pi * step / n)) + 0.05  # cosine decay
        g *= math.exp(r.gauss(0, noise))
        loss *= math.exp(r.gauss(-0.002, noise / 2))
        act *= math.exp(r.gauss(0, noise / 2))
        mom *= math.exp(r.gauss(0, noise / 2))
        row: dict[str, Any] = {"step": step, "g": g * lr_scale, "loss": loss, "act": act,
                               "mom": mom if momentum else None, "param": param,
                               "nonfinite": False}
        for kind, at in events:
            if kind == "spike" and step == at:
                row["g"] *= r.choice([12, 40, 1e3, 1e6])
            elif kind == "drift" and step >= at:
                row["g"] *= 1.04 ** (step - at)
                row["loss"] *= 1.01 ** (step - at)
            elif kind == "jump" and at <= step < at + r.choice([1, 8, 30]):
                row["loss"] *= r.choice([3, 5, 20])
            elif kind == "vanish" and step >= at:
                row["g"] = 1e-13 * row["g"]
            elif kind == "zero" and step == at:
                row["g"] = 0.0
            elif kind == "nan" and step == at:
                nan_left = r.randint(1, 6)
            elif kind == "early" and step == min(at, 8):
                row["g"] *= 100
        if step in cascade_at:
            growing = 1.0
        if growing:
            growing *= r.choice([1.6, 2.5, 10.0])
            row["g"] *= growing
            row["act"] *= growing
            if row["mom"] is not None:
                row["mom"] *= growing
            if row["g"] > 1e25:
                row["g"] = math.inf
                nan_left = r.randint(2, 10)
                growing = 0.0
        if nan_left:
            nan_left -= 1
            row.update(g=math.nan, loss=math.nan, act=math.nan, nonfinite=True)
        if step % sampled:
            row["act"] = None
        out.append(row)
    return out


def _stats(row: dict[str, Any]) -> StepStats:
    st = StepStats(step=row["step"], lr=0.1, loss=row["loss"], grad_norms={0: row["g"]},
                   param_norms={0: row["param"]},
                   activations={} if row["act"] is None else {"m": row["act"]},
                   state_norms={} if row["mom"] is None else {"momentum_buffer": {0: row["mom"]}})
    if row["g"] == 0.0:
        st.grad_norms = {}
    if row["nonfinite"] or not math.isfinite(row["g"]):
        st.nonfinite_grads = {0}
    return st


def _config(seed: int) -> DetectConfig:
    if seed % 3 == 0:
        return DetectConfig()
    r = random.Random(1000 + seed)
    return DetectConfig(warmup_steps=r.choice([0, 1, 3, 20]), window=r.choice([1, 5, 100]),
                        cascade_steps=r.choice([1, 2, 3]), divergence_steps=r.choice([1, 2, 5]),
                        vanishing_steps=r.choice([1, 3, 20]), cooldown=r.choice([0, 5, 50]),
                        spike_cooldown=r.choice([0, 3]))


def _full_pass(detectors: list[Detector], st: StepStats, phase: str) -> list[Any]:
    """Every detector's `check` of `phase`; `both` (a step read after its update) is pre then
    post, as the guard runs them."""
    return [a for ph in (("pre", "post") if phase == "both" else (phase,))
            for d in detectors if d.phase == ph for a in d.check(st)]


class _Path:
    """Fresh default detectors, replayed through the gate or the full pass."""

    def __init__(self, config: DetectConfig, gated: bool, phases: tuple[str, ...]) -> None:
        self.detectors: list[Detector] = default_detectors(config)
        self.gate = QuietGate(self.detectors) if gated else None
        self.phases = phases
        self.alarms: list[tuple[Any, ...]] = []

    def step(self, row: dict[str, Any]) -> None:
        st = _stats(row)
        for phase in self.phases:
            signals = st.seal()  # what the guard does before detecting
            if self.gate is not None:
                found = self.gate.run(st, phase, signals)
            else:
                found = _full_pass(self.detectors, st, phase)
            self.alarms += [(a.step, a.kind, a.signal, repr(a.value), a.message, a.cause)
                            for a in found]

    def state(self) -> str:
        return json.dumps([d.state_dict() for d in self.detectors])

    def resume(self) -> None:
        state = json.loads(self.state())
        gated = self.gate is not None
        self.detectors = default_detectors(self.detectors[0].config)
        for d, s in zip(self.detectors, state, strict=True):
            d.load_state_dict(s)
        self.gate = QuietGate(self.detectors) if gated else None


@pytest.mark.parametrize("phases", [("both",), ("pre", "post")])
def test_gate_same_alarms_and_state_as_full_pass(phases: tuple[str, ...]) -> None:
    passed = total = fired = 0
    kinds: set[str] = set()
    for seed in range(90):
        trace, config = _trace(seed), _config(seed)
        full, gated = _Path(config, False, phases), _Path(config, True, phases)
        resume_at = len(trace) // 2 if seed % 2 else -1
        for i, row in enumerate(trace):
            if i == resume_at:
                full.resume()
                gated.resume()
            full.step(row)
            gated.step(row)
            if i % 37 == 0:  # the states agree all along, not only at the end
                assert gated.state() == full.state(), (seed, i)
        assert gated.alarms == full.alarms, seed
        assert gated.state() == full.state(), seed
        assert gated.gate is not None
        passed += gated.gate.passed
        total += len(trace) * len(phases)
        fired += len(full.alarms)
        kinds |= {a[1] for a in full.alarms}
    # Not vacuous: the gate took a large share of the steps, and the traces raise every kind
    # of alarm. (The traces are random walks with up to 30% noise per step: their loss and
    # grad norm often stand 1.5x over the median of their latest steps, where the trend test
    # of the spike detector needs the full pass; real runs' noise sits around a level.)
    assert passed > 0.4 * total
    assert fired > 100
    assert {"nonfinite", "spike", "cascade", "forecast", "divergence", "vanishing"} <= kinds


def _wild_stats(r: random.Random, step: int, level: list[float]) -> StepStats:
    """A step drawn to reach the quiet updates' edges: zero, negative, tiny, huge and non-finite
    values, signals measured or not, a parameter norm of zero, LR jumps; and long calm runs
    between (levels drift), so windows fill and medians settle."""
    def pick(i: int, lo: float = 0.0) -> float | None:
        u = r.random()
        if u < 0.75:
            level[i] *= math.exp(r.gauss(0, 0.05))
            return level[i]
        return r.choice([0.0, -1.0, lo, 1e-30, 1e30, math.inf, math.nan, None,
                         level[i] * r.choice([1.6, 2.5, 12.0, 40.0, 0.3])])

    g, loss, act, mom, param = (pick(0), pick(1, -0.5), pick(2), pick(3), pick(4))
    g = 1.0 if g is None else g
    param = 1.0 if param is None or param < 0 else param
    st = StepStats(step=step, lr=r.choice([0.1, 0.1, 0.1, 0.01, 1.0]), loss=loss,
                   grad_norms={} if g == 0.0 else {0: abs(g)}, param_norms={0: param},
                   activations={} if act is None else {"m": act},
                   state_norms={} if mom is None else {"momentum_buffer": {0: mom}})
    if not math.isfinite(g):
        st.nonfinite_grads = {0}
    return st


@pytest.mark.parametrize("phases", [("both",), ("pre", "post")])
def test_gate_same_alarms_and_state_on_wild_steps(phases: tuple[str, ...]) -> None:
    """Seeded random steps at the edges of every quiet update (`_wild_stats`), small windows and
    short runs in the configs, the loss-trend tests turned off halfway on odd seeds (as the
    objective does): the gate and the full pass raise the same alarms (cause included) and
    leave the same state all along."""
    taken = 0
    for seed in range(30):
        r = random.Random(seed)
        config = _config(seed + 1)
        full, gated = _Path(config, False, phases), _Path(config, True, phases)
        levels = [r.uniform(0.1, 10) for _ in range(5)]
        for step in range(120):
            if step == 60 and seed % 2:  # the objective found non-stationary mid-run
                for d in (*full.detectors, *gated.detectors):
                    if hasattr(d, "nonstationary"):
                        d.nonstationary = True
            st = _wild_stats(r, step, levels)
            for path in (full, gated):
                for phase in phases:
                    signals = st.seal()
                    if path.gate is not None:
                        found = path.gate.run(st, phase, signals)
                    else:
                        found = _full_pass(path.detectors, st, phase)
                    path.alarms += [(a.step, a.kind, a.signal, repr(a.value), a.message,
                                     a.cause) for a in found]
            if step % 10 == 9:
                assert gated.state() == full.state(), (seed, step)
        assert gated.alarms == full.alarms, seed
        assert gated.gate is not None
        taken += gated.gate.passed
    print(f"gate passed {taken} of {30 * 120 * len(phases)} phases")
    assert taken > 300  # the quiet updates were taken, not only the full tests


def test_gate_takes_healthy_steps() -> None:
    """A healthy run with default settings: the gate takes every step, those whose gradient
    norm grew 1.5x over the last one included (a growth run too short to be a cascade), but
    the few where the grad norm (a random walk here) stands 1.5x over the median of its
    latest 16 values, or the loss 1.1x over its own, which the spike detector's trend test
    looks at in full."""
    r = random.Random(0)
    path = _Path(DetectConfig(), True, ("both",))
    g, loss = 1.0, 2.0
    gs: list[float] = []
    losses: list[float] = []
    over = 0
    for step in range(1000):
        g *= math.exp(r.gauss(0, 0.1))
        loss *= math.exp(r.gauss(-0.001, 0.03))
        if len(gs) >= 20 and (g >= 1.5 * statistics.median(gs[-16:])
                              or loss >= 1.1 * statistics.median(losses[-16:])):
            over += 1
        gs.append(g)
        losses.append(loss)
        path.step({"step": step, "g": g, "loss": loss, "act": 3.0 + r.random(), "mom": g / 2,
                   "param": 10.0, "nonfinite": False})
    assert not path.alarms
    assert path.gate is not None and path.gate.passed == 1000 - over and over < 120


def test_gate_off_by_config_runs_every_check() -> None:
    """`DetectConfig(quiet_gate=False)`: every step takes every detector's `check`."""
    calls = _counting_checks(DetectConfig(quiet_gate=False), steps=50)
    assert calls == {"quiet": 0, "check": 50 * 7}


def test_subclass_without_its_quiet_update_takes_check() -> None:
    """A detector subclass that changes `check` but not `quiet` never takes the inherited
    quiet update (it would stand in for a test it does not know); the others keep theirs."""
    seen: list[int] = []

    class Mine(SpikeDetector):
        def check(self, stats: StepStats) -> list[Any]:
            seen.append(stats.step)
            return super().check(stats)

    dets = default_detectors(DetectConfig())
    dets[1] = Mine(DetectConfig())
    gate = QuietGate(dets)
    for step in range(30):
        st = StepStats(step=step, loss=1.0, grad_norms={0: 1.0}, param_norms={0: 1.0})
        gate.run(st, "both", st.seal())
    assert seen == list(range(30))
    assert gate.passed == 0


def test_any_detector_set() -> None:
    """The gate is a loop over whatever detectors it is given: a set without the vanishing
    detector, or with a second one, takes the quiet updates and agrees with `check`."""
    config = DetectConfig()
    for make in (lambda: default_detectors(config)[:-1],
                 lambda: [*default_detectors(config), VanishingDetector(config)]):
        full, gated = _Path(config, False, ("both",)), _Path(config, True, ("both",))
        full.detectors, gated.detectors = make(), make()
        gated.gate = QuietGate(gated.detectors)
        for row in _trace(10):  # spikes, a cascade, its NaN, vanishing gradients
            full.step(row)
            gated.step(row)
        assert gated.alarms == full.alarms and full.alarms
        assert gated.state() == full.state()
        assert gated.gate.passed > 0


def test_nonfinite_step_takes_every_check() -> None:
    """A step holding a NaN goes through every `check` (the non-finite detectors' business),
    and its alarm is raised; the quiet steps around it take the quiet updates."""
    calls = _counting_checks(DetectConfig(), steps=30, nan_at=20)
    assert calls["check"] >= 7  # the NaN step (and the one that ends its episode)
    assert calls["quiet"] >= 25 * 4


def _counting_checks(config: DetectConfig, steps: int, nan_at: int = -1) -> dict[str, int]:
    """Calls of the detectors' `check` and `quiet` over a healthy series through the gate."""
    calls = {"quiet": 0, "check": 0}
    dets = default_detectors(config)
    for d in dets:
        for name in calls:
            method = getattr(d, name)

            def counted(*args: Any, _m: Any = method, _n: str = name) -> Any:
                calls[_n] += 1
                return _m(*args)

            setattr(d, name, counted)
    gate = QuietGate(dets)
    alarms = []
    for step in range(steps):
        bad = step == nan_at
        st = StepStats(step=step, loss=math.nan if bad else 1.0 + 0.01 * (step % 5),
                       grad_norms={0: 1.0 + 0.1 * (step % 3)}, param_norms={0: 5.0})
        if bad:
            st.nonfinite_grads = {0}
            st.grad_norms = {0: math.nan}
        alarms += gate.run(st, "both", st.seal())
    assert {a.kind for a in alarms} == ({"nonfinite"} if nan_at >= 0 else set())
    return calls
