"""The transformers callback's state goes into the Trainer's checkpoints and comes back with
`train(resume_from_checkpoint=...)`: a real Trainer (2-layer GPT-2 from a config, CPU) with a
NaN row at step 2 under `skip` saves `checkpoint-4/`, stops, and a new Trainer with a new
callback resumes from it. The resumed guard counts on from step 4, keeps the step-2 alarm, skip
and finding, records into the same run folder, and ends with the alarms and actions of one
uninterrupted run. Both ways of naming the checkpoint are covered: a plain callback with a
folder moved out of `output_dir`, and `NanguardTrainer` with `resume_from_checkpoint=True`."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

from hf_rig import BATCH, QUIET, Embeds, make_args, make_model  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from nanguard.integrations.transformers import NanguardCallback, NanguardTrainer  # noqa: E402

STEPS, SAVE, BAD = 8, 4, 2
DATA = Embeds(BATCH * STEPS, BAD * BATCH + 1)


class StopAt(TrainerCallback):
    """Ends training after step `at` (the checkpoint of that step is written first)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            control.should_training_stop = True


def _args(tmp_path):
    return make_args(tmp_path, STEPS, save_strategy="steps", save_steps=SAVE)


def _summary(report: dict) -> dict:
    return {"steps": report["steps"], "status": report["status"],
            "first": (report["first_nonfinite"] or {}).get("step"),
            "alarms": [(a["step"], a["kind"], a["signal"]) for a in report["alarms"]],
            "actions": [(a["step"], a["action"]) for a in report["actions"]]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    cb = NanguardCallback(policy="skip", out=tmp / "run", config=QUIET)
    Trainer(model=make_model(), args=_args(tmp), train_dataset=DATA, callbacks=[cb]).train()
    return _summary(json.loads((tmp / "run" / "report.json").read_text()))


def _first_half(tmp_path):
    cb = NanguardCallback(policy="skip", out=tmp_path / "run", config=QUIET)
    Trainer(model=make_model(), args=_args(tmp_path), train_dataset=DATA,
            callbacks=[cb, StopAt(SAVE)]).train()
    ckpt = tmp_path / "hf" / f"checkpoint-{SAVE}"
    saved = json.loads((ckpt / "nanguard_state.json").read_text())  # plain JSON, no pickle
    assert saved["guard"]["step"] == SAVE
    assert [a["step"] for a in saved["guard"]["actions"]] == [BAD]
    return ckpt


def test_plain_callback_resumes_from_a_moved_checkpoint(tmp_path, uninterrupted):
    ckpt = _first_half(tmp_path)
    moved = tmp_path / "elsewhere"
    shutil.move(str(tmp_path / "hf"), moved)  # output_dir/checkpoint-N no longer exists
    cb = NanguardCallback(policy="skip", config=QUIET)  # out: the run folder in the state
    steps_seen: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps_seen.append(cb.guard.step)

    trainer = Trainer(model=make_model(), args=_args(tmp_path), train_dataset=DATA,
                      callbacks=[cb, Steps()])
    trainer.train(resume_from_checkpoint=str(moved / ckpt.name))
    assert steps_seen == list(range(SAVE + 1, STEPS + 1))
    assert cb.guard is not None and cb.guard.folder is not None
    assert cb.guard.folder.samefile(tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert _summary(report) == uninterrupted
    assert uninterrupted["actions"] == [(BAD, "skip")] and uninterrupted["first"] == BAD


def test_nanguard_trainer_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    _first_half(tmp_path)
    trainer = NanguardTrainer(model=make_model(), args=_args(tmp_path), train_dataset=DATA,
                              nanguard={"policy": "skip", "config": QUIET})
    trainer.train(resume_from_checkpoint=True)
    assert trainer.nanguard_callback.report is not None
    assert _summary(json.loads((tmp_path / "run" / "report.json").read_text())) == uninterrupted
    # the last checkpoint (step 8) carries the state of the finished run
    saved = json.loads((tmp_path / "hf" / f"checkpoint-{STEPS}" / "nanguard_state.json")
                       .read_text())
    assert saved["guard"]["step"] == STEPS


def test_resume_without_a_saved_state_warns_and_starts_afresh(tmp_path):
    Trainer(model=make_model(), args=_args(tmp_path), train_dataset=DATA,
            callbacks=[StopAt(SAVE)]).train()  # no nanguard in the first half
    cb = NanguardCallback(policy="skip", out=tmp_path / "run", config=QUIET)
    trainer = Trainer(model=make_model(), args=_args(tmp_path), train_dataset=DATA,
                      callbacks=[cb])
    with pytest.warns(UserWarning, match="starts afresh"):
        trainer.train(resume_from_checkpoint=True)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["steps"] == STEPS - SAVE


def test_manifests_written_at_save_and_verified_at_resume(tmp_path, caplog):
    """`manifests=True`: `checkpoint-4/` gets a manifest that verifies as saved; after one bit
    of one weight flips in `model.safetensors` (every value still finite), the resumed run
    says so (an ERROR line) and its report carries a `checkpoint_mismatch` alarm at its first
    step naming that tensor (found independently, by comparing the weights) and the cause
    `checkpoint_corrupt`; a resume from an untouched copy raises nothing."""
    import struct

    import torch
    from safetensors.torch import load_file

    from nanguard.audit import verify_manifest

    data = Embeds(BATCH * STEPS, None)  # healthy: only the manifest can tell
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET, manifests=True)
    Trainer(model=make_model(), args=_args(tmp_path), train_dataset=data,
            callbacks=[cb, StopAt(SAVE)]).train()
    ckpt = tmp_path / "hf" / f"checkpoint-{SAVE}"
    assert (ckpt / "nanguard-manifest.json").is_file()
    check = verify_manifest(ckpt)
    assert check.ok and check.checked > 20
    clean = tmp_path / "clean"
    shutil.copytree(ckpt, clean)

    weights = ckpt / "model.safetensors"
    before = {k: v.clone() for k, v in load_file(weights).items()}
    with open(weights, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    name = next(k for k in header if k.endswith("mlp.c_fc.weight"))
    offset = 8 + n + header[name]["data_offsets"][0] + 4 * 3
    with open(weights, "rb+") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    after = load_file(weights)
    assert [k for k in before if not before[k].equal(after[k])] == [name]
    assert torch.isfinite(after[name]).all()

    def resume(folder, out):
        cb = NanguardCallback(out=out, config=QUIET, manifests=True)
        Trainer(model=make_model(), args=_args(tmp_path), train_dataset=data,
                callbacks=[cb]).train(resume_from_checkpoint=str(folder))
        return json.loads((out / "report.json").read_text())

    with caplog.at_level("ERROR", logger="nanguard"):
        report = resume(ckpt, tmp_path / "resumed")
    assert any("differs from its manifest" in r.getMessage() and name in r.getMessage()
               for r in caplog.records)
    [alarm] = [a for a in report["alarms"] if a["kind"] == "checkpoint_mismatch"]
    assert alarm["step"] == SAVE and name in alarm["message"]
    assert report["status"] != "healthy" and report["diagnosis"][0]["cause"] == \
        "checkpoint_corrupt"
    good = resume(clean, tmp_path / "resumed_clean")
    assert not [a for a in good["alarms"] if a["kind"] == "checkpoint_mismatch"]
