"""benchmarks/host_cost.py runs and prints its JSON line (a smoke test: no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_cost.py"


def test_host_cost_quick(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("host_cost", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "host_cost", mod)  # its dataclasses look it up
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--workloads", "logreg,blocks", "--steps", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"logreg", "blocks", "steps"}
    assert result["blocks"]["store_bytes_per_step"] > 0
