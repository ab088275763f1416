"""The detectors' sorted windows give exactly what sorting the window at every lookup gave."""

from __future__ import annotations

import copy
import json
import math
import pickle
import random
import statistics
from typing import Any

import pytest

from nanguard.config import DetectConfig
from nanguard.detect import default_detectors
from nanguard.detect.series import Window
from nanguard.watch.stats import StepStats


def test_window_matches_statistics_median() -> None:
    rng = random.Random(0)
    for maxlen in (1, 2, 3, 10, 100):
        w, ref = Window(maxlen=maxlen), []
        for _ in range(500):
            # Ties and signed zeros: the very objects must leave in deque order.
            v = rng.choice([0.0, -0.0, 1.0, float(rng.randint(0, 3)), rng.gauss(0, 1)])
            w.append(v)
            ref = [*ref, v][-maxlen:]
            assert list(w) == ref
            assert all(a is b for a, b in zip(w.sorted, sorted(ref), strict=True))
            m = statistics.median(ref)
            assert w.median() == m and math.copysign(1, w.median()) == math.copysign(1, m)
            assert w.mid is w.median()  # the kept median is the one looked up
            assert w.largest() == max(ref)
    for clone in (copy.deepcopy(w), copy.copy(w), pickle.loads(pickle.dumps(w))):
        assert list(clone) == list(w) and clone.sorted == w.sorted and clone.maxlen == w.maxlen
    assert Window([3.0, 1.0, 2.0], maxlen=2).sorted == [1.0, 2.0]


def _series(seed: int) -> list[tuple[int, float, float, float, float]]:
    """Noisy healthy signals with spikes, loss jumps, non-finite steps and (odd seeds) a
    cascade: every detector fires somewhere."""
    r = random.Random(seed)
    g, loss, act, mom = 1.0, 2.0, 5.0, 0.5
    out = []
    for step in range(500):
        g *= math.exp(r.gauss(0, 0.2))
        loss *= math.exp(r.gauss(-0.001, 0.05))
        act *= math.exp(r.gauss(0, 0.1))
        mom *= math.exp(r.gauss(0, 0.1))
        gg, ll, aa = g, loss, act
        e = r.random()
        if e < 0.03:
            gg = g * r.choice([15, 40, 1e3, 1e6])
        elif e < 0.05:
            ll = loss * r.choice([3, 10, 100])
        elif e < 0.06:
            gg = r.choice([math.inf, math.nan, 0.0])
        elif e < 0.08:
            loss *= 5
        if 300 <= step < 330 and seed % 2:
            gg, aa = g * 2.5 ** (step - 299), act * 2 ** (step - 299)
        out.append((step, gg, ll, aa, mom))
    return out


def _run(detectors: list[Any], series: list[tuple[int, float, float, float, float]]) -> list[Any]:
    alarms = []
    for step, g, loss, act, mom in series:
        st = StepStats(step=step, lr=0.1, loss=loss, grad_norms={0: g}, param_norms={0: 10.0},
                       activations={"m": act}, state_norms={"momentum_buffer": {0: mom}})
        if not math.isfinite(g):
            st.nonfinite_grads = {0}
        for d in detectors:
            alarms += [(a.step, a.kind, a.signal, repr(a.value), a.message) for a in d.check(st)]
    return alarms


@pytest.mark.parametrize("seed", range(6))
def test_detectors_same_alarms_as_sorting_each_lookup(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    series = _series(seed)
    fast = _run(default_detectors(DetectConfig()), series)
    # The reference: every lookup sorts the window again (what the detectors did before).
    monkeypatch.setattr(Window, "median", lambda self: statistics.median(self))
    monkeypatch.setattr(Window, "largest", lambda self: max(self))
    slow = _run(default_detectors(DetectConfig()), series)
    assert fast == slow and len(fast) > 5


def test_state_dict_round_trip_mid_run() -> None:
    series = _series(1)
    whole = _run(default_detectors(DetectConfig()), series)
    first = default_detectors(DetectConfig())
    head = _run(first, series[:250])
    state = json.loads(json.dumps([d.state_dict() for d in first]))
    second = default_detectors(DetectConfig())
    for d, s in zip(second, state, strict=True):
        d.load_state_dict(s)
    assert head + _run(second, series[250:]) == whole
