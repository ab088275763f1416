"""benchmarks/host_cost.py and benchmarks/batch_probe.py run and print their JSON line (smoke
tests: no timing asserted; marker `bench`, out of the default run, CI runs them), and the
host-cost floor computes what the guard records (in the default run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.record.writer import combine_sums

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # its dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.bench
def test_host_cost_quick(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = _load("host_cost", monkeypatch)
    assert mod.main(["--quick", "--workloads", "logreg,blocks", "--steps", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"logreg", "blocks", "steps"}
    assert result["blocks"]["store_bytes_per_step"] > 0
    assert all(isinstance(result[w]["op_floor_added_ms"], float) for w in ("logreg", "blocks"))


@pytest.mark.parametrize("label_dtype", [torch.float32, torch.int64])
def test_op_floor_computes_what_the_guard_records(
    label_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The floor is honest: its batch ops give the fingerprints the guard records (combined as
    the run store's writer combines them) and the totals the guard reads (a NaN row makes its
    tensor's total non-finite; the guard finds the row)."""
    mod = _load("host_cost", monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(16, 5)
    x[3, 2] = float("nan")
    y = (torch.randint(0, 3, (16,)) if label_dtype == torch.int64
         else torch.randn(16, 1))
    sums, totals = mod._batch_ops(x, y)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, out="", config=GuardConfig(record=RecordConfig(summary=False)))
    guard.watch(loss=model(torch.nan_to_num(x)).sum(), batch=(x, y))
    model(torch.nan_to_num(x)).sum().backward()
    opt.step()
    guard.close()
    stats = guard.history[-1]
    assert stats.sample_hashes == combine_sums((sums, 2, (16,)))
    assert len(totals) == (2 if label_dtype == torch.float32 else 1)
    assert [v != v for v in totals] == [True] + [False] * (len(totals) - 1)
    assert stats.nonfinite_samples == [3] and stats.nonfinite_tensors == [0]


@pytest.mark.bench
def test_batch_probe_quick(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = _load("batch_probe", monkeypatch)
    assert mod.main(["--quick"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"tabular 8x4", "images 2x3x8x8"}
    for row in result.values():
        assert row["before_ms"] > 0 and row["now_ms"] > 0 and row["forward_ms"] > 0


@pytest.mark.bench
def test_ab_inprocess_quick(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """This checkout against itself, renamed: the loader makes a second, independent package."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    mod = _load("ab_inprocess", monkeypatch)
    src = BENCHMARKS.parent / "src"
    try:
        assert mod.main(["--before", str(src), "--rounds", "2", "--warmup", "1",
                         "--workloads", "logreg"]) == 0
        before = sys.modules["nanguard_before"]
        assert before.Guard is not mod.nanguard.Guard
        assert Path(before.__file__).parent.name == "nanguard_before"
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "nanguard_before"]:
            del sys.modules[name]
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"logreg"} and result["logreg"]["plain_ms"] > 0
    with pytest.raises(SystemExit):
        mod.main(["--before", str(BENCHMARKS)])  # no nanguard package there: a usage error


@pytest.mark.bench
def test_step_parts_quick(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every part is timed inside a real guarded step (its wrapper reached the hooks the
    guard registered), and the wrappers are gone afterwards."""
    _load("host_cost", monkeypatch)
    mod = _load("step_parts", monkeypatch)
    from nanguard.step.pipeline import StepPipeline

    before = StepPipeline.pre_hook
    assert mod.main(["--quick", "--workloads", "logreg"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["logreg"]) == set(mod.PARTS) | {"clip_call"}
    assert StepPipeline.pre_hook is before
