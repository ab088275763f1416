"""Checkpoint manifests: `nanguard.save` / `write_manifest` record per-tensor hashes, and
`nanguard audit` names exactly the tensor whose bytes changed after the save (a bit flipped in
the file on disk, torch and safetensors alike; an element edited and re-saved), missing, extra,
re-typed and reshaped tensors, and shards of a folder; an untouched checkpoint passes."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile

import pytest
import torch
from audit_helpers import assert_one_line_error
from safetensors.torch import load_file, save_file
from torch import nn

import nanguard
from nanguard.audit import audit_checkpoint, verify_manifest, write_manifest


def _trained_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 2, (4,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _flip_bit_on_disk(path, offset: int, bit: int = 3) -> None:
    with open(path, "rb+") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _torch_storage_offset(path, storage: str) -> int:
    """File offset of a storage's bytes in a torch zip checkpoint (stored uncompressed)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"archive/data/{storage}")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _safetensors_offset(path, name: str) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[name]["data_offsets"][0]


def _changed(a: dict, b: dict) -> set[str]:
    """Ground truth, independent of the manifest: which tensors differ bit for bit."""
    from nanguard.audit.ckpt_load import flatten

    fa, fb = dict(flatten(a)), dict(flatten(b))

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return {
        k for k, v in fa.items() if isinstance(v, torch.Tensor) and not raw(v).equal(raw(fb[k]))
    }


def test_untouched_checkpoints_pass(tmp_path, cli):
    state = _trained_state()
    manifest = nanguard.save(state, tmp_path / "ckpt.pt")
    assert manifest == f"{tmp_path / 'ckpt.pt'}.nanguard-manifest.json"
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.nanguard-manifest.json"]
    nanguard.save(state["model"], tmp_path / "model.safetensors")
    for name in ("ckpt.pt", "model.safetensors"):
        report = audit_checkpoint(tmp_path / name)
        assert report.ok and report.manifest is not None and report.manifest.ok
        assert report.manifest.checked == len(report.tensors)
        code, out, _ = cli("audit", tmp_path / name)
        assert code == 0 and "all match" in out, out
    assert verify_manifest(tmp_path / "ckpt.pt").checked == 16  # 4 params + 3 x 4 Adam state


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_one_bit_flipped_on_disk_is_named(tmp_path, cli, fmt):
    state = _trained_state()
    if fmt == "torch":
        path = tmp_path / "ckpt.pt"
        nanguard.save(state, path)
        offset = _torch_storage_offset(path, "2") + 4 * 7  # an element inside storage 2
        before = state
    else:
        path = tmp_path / "model.safetensors"
        nanguard.save(state["model"], path)
        offset = _safetensors_offset(path, "2.weight") + 4 * 5
        before = state["model"]
    _flip_bit_on_disk(path, offset)
    after = torch.load(path, weights_only=True) if fmt == "torch" else load_file(path)
    truth = _changed(before, after)
    assert len(truth) == 1  # one tensor really changed, by one bit

    check = verify_manifest(path)
    assert [(m.name, m.status) for m in check.mismatches] == [(truth.pop(), "changed")]
    name = check.mismatches[0].name
    code, out, _ = cli("audit", path, "--format", "json")
    data = json.loads(out)
    assert code == 1 and not data["ok"]
    assert [f["location"] for f in data["findings"]] == [name]
    assert data["findings"][0]["code"] == "manifest_mismatch"
    code, out, _ = cli("audit", path)
    assert code == 1 and "1 mismatch(es)" in out and name in out


def test_element_edited_and_resaved_is_named(tmp_path):
    state = _trained_state()
    path = tmp_path / "ckpt.pt"
    nanguard.save(state, path)
    loaded = torch.load(path, weights_only=True)
    loaded["optimizer"]["state"][1]["exp_avg_sq"][0] += 1e-12  # one element, by one ulp-ish
    torch.save(loaded, path)  # rewritten without nanguard: the manifest is the old one
    report = audit_checkpoint(path)
    assert [f.location for f in report.findings] == ["optimizer.state.1.exp_avg_sq"]


def test_missing_extra_dtype_shape_and_scalars(tmp_path):
    state = _trained_state()
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    write_manifest(state, path)
    model = dict(state["model"])
    del model["0.bias"]
    model["extra"] = torch.zeros(2)
    model["0.weight"] = model["0.weight"].double()
    model["2.weight"] = model["2.weight"].reshape(-1)
    opt = state["optimizer"]
    opt["param_groups"][0]["lr"] = 0.5
    torch.save({"model": model, "optimizer": opt}, path)
    check = verify_manifest(path)
    got = {(m.name, m.status) for m in check.mismatches}
    assert got == {
        ("model.0.bias", "missing"),
        ("model.extra", "extra"),
        ("model.0.weight", "dtype"),
        ("model.2.weight", "shape"),
        ("optimizer.param_groups.0.lr", "changed"),
    }


def test_folder_of_shards(tmp_path, cli):
    model = _trained_state()["model"]
    folder = tmp_path / "shards"
    folder.mkdir()
    save_file({k: v for k, v in model.items() if k.startswith("0.")}, folder / "a.safetensors")
    save_file({k: v for k, v in model.items() if k.startswith("2.")}, folder / "b.safetensors")
    (folder / "config.json").write_text("{}")  # not a checkpoint: not listed
    manifest = write_manifest(folder)
    assert os.path.basename(manifest) == "nanguard-manifest.json"
    assert verify_manifest(folder).ok and verify_manifest(folder).checked == 4
    _flip_bit_on_disk(
        folder / "b.safetensors", _safetensors_offset(folder / "b.safetensors", "2.bias")
    )
    check = verify_manifest(folder)
    assert [(m.file, m.name) for m in check.mismatches] == [("b.safetensors", "2.bias")]
    code, out, _ = cli("audit", folder / "a.safetensors")  # the folder's manifest, its entries
    assert code == 0 and "all match" in out
    code, _, _ = cli("audit", folder / "b.safetensors")
    assert code == 1
    shutil.move(folder / "a.safetensors", tmp_path / "a.safetensors")
    statuses = {(m.name, m.status) for m in verify_manifest(folder).mismatches}
    assert ("a.safetensors", "missing_file") in statuses


def test_manifest_flag_and_bad_input(tmp_path, cli):
    state = _trained_state()
    path = tmp_path / "ckpt.pt"
    nanguard.save(state, path)
    moved = tmp_path / "elsewhere.json"
    os.replace(f"{path}.nanguard-manifest.json", moved)
    code, out, _ = cli("audit", path)
    assert code == 0 and "tensors verified" not in out  # none beside it: no check, no noise
    code, out, _ = cli("audit", path, "--manifest", moved)
    assert code == 0 and "16 tensors verified, all match" in out
    code, _, err = cli("audit", path, "--manifest", tmp_path / "nope.json")
    assert_one_line_error(code, err)
    moved.write_text("{not json")
    code, _, err = cli("audit", path, "--manifest", moved)
    assert_one_line_error(code, err)
    code, _, err = cli("audit", path, path, "--manifest", moved)
    assert_one_line_error(code, err)
    os.replace(moved, f"{path}.nanguard-manifest.json")  # a garbled manifest found beside it
    code, out, _ = cli("audit", path)
    assert code == 1 and "manifest_unreadable" in out
    with pytest.raises(ValueError, match="state dict"):
        nanguard.save(nn.Linear(2, 2), tmp_path / "module.pt")
    tied = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="tied weights"):
        nanguard.save({"embed": tied, "head": tied}, tmp_path / "tied.safetensors")
    assert not list(tmp_path.glob("*tied*")) and not list(tmp_path.glob(".*"))  # no leftovers


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_load_verifies_before_handing_over(tmp_path, fmt):
    """`nanguard.load`: an untouched checkpoint loads and equals what was saved; one bit
    flipped on disk is refused with a one-line error naming exactly the tensor that changed
    (the ground truth read back independently); `verify=False` loads it anyway."""
    state = _trained_state()
    if fmt == "torch":
        path = tmp_path / "ckpt.pt"
        nanguard.save(state, path)
        before, offset = state, _torch_storage_offset(path, "2") + 4 * 7
    else:
        path = tmp_path / "model.safetensors"
        nanguard.save(state["model"], path)
        before, offset = state["model"], _safetensors_offset(path, "2.weight") + 4 * 5
    assert _changed(before, nanguard.load(path)) == set()
    _flip_bit_on_disk(path, offset)
    after = torch.load(path, weights_only=True) if fmt == "torch" else load_file(path)
    (truth,) = _changed(before, after)
    with pytest.raises(ValueError) as info:
        nanguard.load(path)
    assert isinstance(info.value, nanguard.CheckpointMismatch)
    assert "\n" not in str(info.value) and truth in str(info.value)
    assert [(m.name, m.status) for m in info.value.check.mismatches] == [(truth, "changed")]
    assert _changed(before, nanguard.load(path, verify=False)) == {truth}


def test_load_without_manifest_and_bad_input(tmp_path):
    state = _trained_state()
    torch.save(state, tmp_path / "plain.pt")  # no manifest: nothing to verify against
    assert _changed(state, nanguard.load(tmp_path / "plain.pt")) == set()
    with pytest.raises(ValueError, match="no such checkpoint file"):
        nanguard.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot load") as info:
        nanguard.load(tmp_path / "junk.pt")
    assert "\n" not in str(info.value)

    class Evil:  # a pickle that would run code: refused, never executed
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="cannot load"):
        nanguard.load(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


def test_folder_with_files_unsafe_to_load(tmp_path, cli):
    """A Trainer-style `checkpoint-N/`: weights, and an `rng_state.pth` that only unpickles by
    running code (NumPy's RNG state). The manifest hashes that file as bytes without loading
    it; `nanguard audit DIR` passes untouched and names the file once one bit of it flips."""
    import numpy as np

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    save_file(_trained_state()["model"], folder / "model.safetensors")
    torch.save({"numpy": np.random.get_state(), "python": (3, (1, 2), None)},
               folder / "rng_state.pth")
    write_manifest(folder)
    listed = json.loads((folder / "nanguard-manifest.json").read_text())["files"]
    assert set(listed["rng_state.pth"]) >= {"file_sha256"} and not listed["rng_state.pth"][
        "tensors"]
    assert verify_manifest(folder).ok
    code, out, _ = cli("audit", folder)
    assert code == 0, out
    _flip_bit_on_disk(folder / "rng_state.pth", 200)
    assert [(m.name, m.status) for m in verify_manifest(folder).mismatches] == [
        ("rng_state.pth", "changed")]
    code, out, _ = cli("audit", folder)
    assert code == 1 and "manifest_mismatch" in out and "rng_state.pth" in out, out


def test_a_checkpoint_saved_again_without_its_manifest_is_called_that(tmp_path):
    """A plain `torch.save` over a file `nanguard.save` wrote leaves the old manifest beside
    it: every tensor then differs, and the message says the file is newer than its manifest
    (saved again) instead of blaming storage; a flip that leaves the file's time alone (bit rot,
    memory) keeps the corruption wording."""
    path = tmp_path / "ckpt.pt"
    nanguard.save(_trained_state(), path)
    manifest = f"{path}.nanguard-manifest.json"
    torch.save(_trained_state() | {"step": 7}, path)  # the next save, without nanguard.save
    old = os.path.getmtime(path) - 60
    os.utime(manifest, (old, old))  # the manifest is from the save before
    with pytest.raises(nanguard.CheckpointMismatch, match="written after its manifest"):
        nanguard.load(path)
    nanguard.save(_trained_state(), path)
    stamp = os.path.getmtime(path)
    _flip_bit_on_disk(path, _torch_storage_offset(path, "2") + 4)
    os.utime(path, (stamp, stamp))  # bit rot does not touch the modification time
    with pytest.raises(nanguard.CheckpointMismatch, match="storage, copy or memory corruption"):
        nanguard.load(path)
