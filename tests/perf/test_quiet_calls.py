"""Python calls nanguard makes per quiet step of the default guard, counted with cProfile.

Counted through the public entry points only: a `Guard` on nn.Linear(20, 1), its config's
`DetectConfig.quiet_gate` on or off. The test pins issue 39's <= 30, that the quiet gate
saves what it saves, and that on quiet steps no detector runs its full test (`check`): each
takes its quiet update. The history of the number and where the calls go are in
BENCHMARKS.md; the calls are not where the time goes (~0.1 us each, of the ~150 us the guard
adds to this step).
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

import torch

import nanguard
from nanguard import DetectConfig, GuardConfig, RecordConfig

# Issue 39's target (29.76 reached: one function per hook on the quiet lane, parts with
# nothing to do on a quiet step left out when the pipeline is built, the gate a loop over the
# detectors' quiet updates, one call each, the saturation probe called only on the steps it
# arms).
MAX_CALLS_PER_STEP = 30
# The same guard with the gate off: what the gate saves must stay saved.
MIN_SAVED_BY_GATE = 25


def calls_by_function(tmp: Path, gate: bool = True, policy: str = "observe"
                      ) -> dict[tuple[str, int, str], int]:
    """nanguard's Python calls over 100 quiet steps, past the detectors' warm-up, by function
    (file, line, name)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GuardConfig(record=RecordConfig(summary=False),
                         detect=DetectConfig(quiet_gate=gate))
    g = nanguard.Guard(model, opt, out=tmp, config=config, policy=policy)
    x, y = torch.randn(64, 20), torch.randn(64, 1)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        g.watch(loss=loss, batch=(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(50):  # past the detectors' warm-up
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        step()
    prof.disable()
    g.close()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return {k: v[1] for k, v in stats.items() if "nanguard" in Path(k[0]).parts}


def calls_per_step(tmp: Path, gate: bool) -> tuple[float, int]:
    """(nanguard's Python calls per quiet step, calls of a detector's `check` over the 100
    steps counted)."""
    ours = calls_by_function(tmp, gate)
    checks = sum(n for (file, _, name), n in ours.items()
                 if name == "check" and Path(file).parent.name == "detect")
    return sum(ours.values()) / 100, checks


def _in(ours: dict[tuple[str, int, str], int], *files: str) -> dict[str, int]:
    """The calls made in `files` (package/module.py), by function name."""
    return {name: n for (file, _, name), n in ours.items()
            if f"{Path(file).parent.name}/{Path(file).name}" in files}


def test_quiet_step_call_count(tmp_path: Path) -> None:
    on, checks_on = calls_per_step(tmp_path / "on", True)
    off, checks_off = calls_per_step(tmp_path / "off", False)
    print(f"nanguard calls per quiet step: {on:.2f} with the gate, {off:.2f} without")
    assert checks_on == 0  # every quiet step took every detector's quiet update
    assert checks_off == 100 * 7  # ...and without the gate, every detector's full test
    assert on <= MAX_CALLS_PER_STEP, f"{on} nanguard calls per quiet step"
    assert off - on >= MIN_SAVED_BY_GATE, (on, off)


def test_a_quiet_step_leaves_out_what_has_nothing_to_do(tmp_path: Path) -> None:
    """What a step runs is settled when the pipeline is built: under `observe` without a
    GradScaler no part of recovery runs on a quiet step (its per-step parts are left out,
    not called to return), the record takes one row's calls, and the three hooks carry
    their fail-open handling themselves. Under `rollback` the snapshot side does run."""
    ours = calls_by_function(tmp_path / "observe")
    assert _in(ours, "recover/recovery.py", "recover/amp.py") == {}
    assert _in(ours, "step/failopen.py") == {}
    assert sum(_in(ours, "record/rows.py", "record/store.py", "record/writer.py").values()
               ) <= 2 * 100 + 2  # one row per step (and a queued RNG state)
    rolling = _in(calls_by_function(tmp_path / "rollback", policy="rollback"),
                  "recover/recovery.py")
    assert rolling.get("after_update") == 100 and rolling.get("maybe_snapshot") == 100
