"""`nanguard audit`: a planted NaN and a planted outlier in a real trained model + Adam state,
optimizer-state sanity, safetensors streaming, content hashes, the diff of two checkpoints,
JSON output, and that a malicious pickle is refused without its code ever running."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from audit_helpers import assert_one_line_error, run_subprocess
from torch import nn

from nanguard.audit import UnsafeCheckpointError, audit_checkpoint, ckpt_load, diff_checkpoints


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
        nn.ReLU(), nn.Linear(16, 2),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(5):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, d / "good.pt")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["0.bias"][3] = float("nan")
    sd["2.weight"].mul_(1e6)
    torch.save({"model": sd, "optimizer": opt.state_dict()}, d / "bad.pt")
    return d


def test_clean_checkpoint_has_no_findings(ckpts, cli):
    report = audit_checkpoint(ckpts / "good.pt")
    assert report.ok and report.findings == []
    names = {t.name for t in report.tensors}
    assert {"model.0.weight", "optimizer.state.0.exp_avg_sq", "optimizer.state.0.step"} <= names
    code, out, _ = cli("audit", ckpts / "good.pt")
    assert code == 0 and "no problems found" in out


def test_planted_nan_and_outlier_are_found(ckpts):
    report = audit_checkpoint(ckpts / "bad.pt")
    by_code = {f.code: f for f in report.findings}
    assert by_code["nonfinite"].location == "model.0.bias"
    assert by_code["nonfinite"].details["nan"] == 1
    assert by_code["magnitude_outlier"].location == "model.2.weight"
    assert by_code["magnitude_outlier"].details["ratio"] > 1e4
    assert len(report.findings) == 2  # nothing else is flagged


def test_cli_exit_code_and_json(ckpts, cli):
    code, out, _ = cli("audit", ckpts / "bad.pt", "--format", "json")
    assert code == 1
    data = json.loads(out)
    assert not data["ok"]
    assert {f["location"] for f in data["findings"]} == {"model.0.bias", "model.2.weight"}
    code, out, _ = cli("audit", ckpts / "bad.pt")
    assert code == 1 and "model.0.bias" in out and "magnitude_outlier" in out


def test_diff_names_changed_tensors(ckpts, cli):
    diff = diff_checkpoints(ckpts / "good.pt", ckpts / "bad.pt")
    changed = {c.name: c for c in diff.changes}
    assert set(changed) == {"model.0.bias", "model.2.weight"}
    assert changed["model.0.bias"].became_nonfinite
    assert changed["model.2.weight"].rel_change == pytest.approx(1e6 - 1, rel=1e-3)
    assert diff.unchanged == len(diff.a.tensors) - 2
    assert [f.code for f in diff.findings] == ["became_nonfinite"]
    code, out, _ = cli("audit", ckpts / "good.pt", ckpts / "bad.pt")
    assert code == 1 and "2 tensors differ" in out


def test_identical_checkpoints_diff_clean(ckpts):
    diff = diff_checkpoints(ckpts / "good.pt", ckpts / "good.pt")
    assert diff.ok and diff.changes == []


def test_optimizer_state_sanity(tmp_path):
    model, opt = _trained()
    state = opt.state_dict()
    state["state"][0]["exp_avg_sq"][0, 0] = -1.0
    state["state"][1]["step"] = torch.tensor(float("inf"))
    state["param_groups"][0]["lr"] = float("nan")
    torch.save({"optimizer": state}, tmp_path / "opt.pt")
    codes = {(f.code, f.location) for f in audit_checkpoint(tmp_path / "opt.pt").findings}
    assert ("optimizer_state_negative", "optimizer.state.0.exp_avg_sq") in codes
    assert ("optimizer_state_nonfinite", "optimizer.state.1.step") in codes
    assert ("optimizer_state_nonfinite", "optimizer.param_groups.0.lr") in codes


def test_safetensors_streamed_in_chunks_matches_torch(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    tensors = {"big": torch.randn(1000, 7), "half": torch.randn(33).half(), "s": torch.tensor(2.0)}
    tensors["big"][999, 6] = float("inf")
    save_file(tensors, tmp_path / "m.safetensors")
    torch.save(tensors, tmp_path / "m.pt")
    monkeypatch.setattr(ckpt_load, "CHUNK_ELEMS", 100)  # many slices per tensor
    st = {t.name: t for t in audit_checkpoint(tmp_path / "m.safetensors").tensors}
    pt = {t.name: t for t in audit_checkpoint(tmp_path / "m.pt").tensors}
    assert st["big"].posinf == 1 and st["big"].numel == 7000
    for name in tensors:  # same statistics and the same content hash from both formats
        assert st[name].sha256 == pt[name].sha256
        assert st[name].absmax == pytest.approx(pt[name].absmax)
    finite = tensors["big"][torch.isfinite(tensors["big"])].double()
    assert st["big"].rms == pytest.approx(float(finite.pow(2).mean().sqrt()))


class _Evil:
    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (exec, (f"open({self.canary!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("how", ["zip", "legacy", "raw-pickle"])
def test_malicious_pickle_never_runs(tmp_path, cli, how):
    canary = str(tmp_path / "CANARY")
    path = tmp_path / "evil.pt"
    payload = {"model": {"w": torch.ones(2)}, "x": _Evil(canary)}
    if how == "raw-pickle":
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    else:
        torch.save(payload, path, _use_new_zipfile_serialization=how == "zip")
    assert not os.path.exists(canary)
    with pytest.raises(UnsafeCheckpointError, match="unsafe"):
        audit_checkpoint(path)
    code, out, err = cli("audit", path)
    assert_one_line_error(code, err)
    assert "unsafe" in err and "exec" in err
    if how == "zip":  # once as a real process: nothing but one line reaches stderr
        proc = run_subprocess("audit", path)
        assert_one_line_error(proc.returncode, proc.stderr)
    assert not os.path.exists(canary)
