"""Lightning adapter (`nanguard.integrations.lightning.NanguardCallback`) with real Lightning on
CPU: a healthy run is recorded healthy and left bitwise untouched; a NaN row is found at its step
and row (data_nonfinite); `skip` discards exactly that update and training goes on; `rollback`
restores the snapshot and backs off the LR; `raise` stops; the callback state round-trips
through a checkpoint; options are refused early."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lightning")

from lightning_rig import BATCH, ParamRecorder, Regressor, loader, make_data, trainer  # noqa: E402

from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.config import RecoverConfig  # noqa: E402
from nanguard.integrations.lightning import NanguardCallback  # noqa: E402

QUIET = GuardConfig(record=RecordConfig(summary=False))
STEPS = 12


def _fit(cb: list, data, steps: int = STEPS, **kw):
    model = Regressor()
    t = trainer(cb, steps, **kw)
    t.fit(model, loader(data))
    return model, t


def test_healthy_run_is_healthy_and_bitwise_untouched(tmp_path):
    data = make_data(BATCH * STEPS)
    plain, _ = _fit([], data)
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    watched, _ = _fit([cb], data)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "healthy"
    assert report["steps"] == STEPS
    assert report["run"]["entry"] == "lightning"
    assert cb.report is not None and cb.report.status == "healthy"


def test_nan_row_found_at_its_step_and_row(tmp_path):
    bad_row = 5 * BATCH + 3  # step 5, row 3
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    _fit([cb], make_data(BATCH * STEPS, bad_row))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "failed"
    first = report["first_nonfinite"]
    assert first["step"] == 5
    assert first["phase"] == "data"
    assert 3 in first["samples"]
    assert report["diagnosis"][0]["cause"] == "data_nonfinite"


def test_loss_is_watched_as_training_step_returned_it(tmp_path):
    """The loss the guard records is training_step's, also under gradient accumulation
    (Lightning back-propagates loss / accumulate_grad_batches)."""
    from nanguard.record.store import dec, open_run

    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    data = make_data(BATCH * 8)
    t = trainer([cb], 4, accumulate_grad_batches=2)
    t.fit(Regressor(), loader(data))
    assert cb.report is not None and cb.report.steps == 4
    db = open_run(tmp_path / "run")
    losses = [dec(v) for (v,) in db.execute("SELECT loss FROM steps ORDER BY step")]
    db.close()
    # Step 0 keeps the last micro-batch's loss (batch 1) at the initial parameters.
    fresh = Regressor()
    x, y = data.tensors
    with torch.no_grad():
        expected = fresh.training_step((x[BATCH:2 * BATCH], y[BATCH:2 * BATCH]), 1).item()
    assert len(losses) == 4
    assert losses[0] == pytest.approx(expected, rel=1e-5)


def test_skip_discards_exactly_that_update_and_goes_on(tmp_path):
    steps = 60
    bad_step = 30
    rec = ParamRecorder()
    cb = NanguardCallback(policy="skip", out=tmp_path / "run", config=QUIET)
    model, _ = _fit([cb, rec], make_data(BATCH * steps, bad_step * BATCH + 1), steps=steps,
                    max_epochs=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for a, b in zip(rec.after[bad_step - 1], rec.after[bad_step], strict=True):
        assert torch.equal(a, b)  # the bad step changed nothing
    assert any(not torch.equal(a, b)
               for a, b in zip(rec.after[bad_step], rec.after[bad_step + 1], strict=True))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [(a["step"], a["action"]) for a in report["actions"]] == [(bad_step, "skip")]
    assert report["first_nonfinite"]["step"] == bad_step
    assert report["status"] == "recovered"
    assert report["steps"] == steps


def test_rollback_restores_the_snapshot_and_keeps_the_lr_for_a_nan_batch(tmp_path):
    """`rollback` through the callback: at the NaN step the module and Adam go back to the last
    snapshot (the initial state: refreshed every 50 quiet steps here), training goes on
    from there with the next batches, and the LR is kept: the NaN came in the batch's own rows
    (the data, not the LR; the evidence-sized backoff of recover/backoff.py)."""
    steps, bad_step = 60, 30
    init = [p.detach().clone() for p in Regressor().parameters()]
    rec = ParamRecorder()
    # One snapshot, refreshed every 50 steps: the initial state is the last good one at step 30.
    cfg = GuardConfig(record=RecordConfig(summary=False),
                      recover=RecoverConfig(snapshot_every=50, snapshot_slots=1))
    cb = NanguardCallback(policy="rollback", out=tmp_path / "run", config=cfg)
    model, t = _fit([cb, rec], make_data(BATCH * steps, bad_step * BATCH + 1), steps=steps,
                    max_epochs=1)
    for a, b in zip(init, rec.after[bad_step], strict=True):
        assert torch.equal(a, b)  # restored, not merely skipped
    assert not all(torch.equal(a, b) for a, b in zip(init, rec.after[bad_step - 1], strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(init, model.parameters(), strict=True))
    assert t.optimizers[0].param_groups[0]["lr"] == 0.05  # the backoff is per step, not kept
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [(a["step"], a["action"]) for a in report["actions"]] == [(bad_step, "rollback")]
    assert "state of step 0" in report["actions"][0]["detail"]
    assert report["status"] == "recovered" and report["steps"] == steps
    from nanguard.record.store import dec, open_run

    db = open_run(tmp_path / "run")
    lrs = dict(db.execute("SELECT step, lr FROM steps").fetchall())
    db.close()
    assert dec(lrs[bad_step - 1]) == 0.05 and dec(lrs[bad_step + 1]) == 0.05
    assert "the data, not the LR" in report["actions"][0]["detail"]


def test_skip_with_step_scheduler_and_clipping(tmp_path):
    """Gradient clipping runs after the guard (on removed gradients: a no-op) and the
    per-step scheduler keeps stepping."""
    steps, bad_step = 24, 7
    model = Regressor(scheduler=True)
    cb = NanguardCallback(policy="skip", out=tmp_path / "run", config=QUIET)
    t = trainer([cb], steps, gradient_clip_val=1.0)
    t.fit(model, loader(make_data(BATCH * steps, bad_step * BATCH)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert cb.report is not None
    assert [(a["step"], a["action"]) for a in cb.report.actions] == [(bad_step, "skip")]
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 2)


def test_raise_stops_fit_with_the_report(tmp_path, caplog):
    """`raise` stops the Lightning way: fit() returns (no traceback), the failing update is
    not applied, the report is written and a log line says why."""
    cb = NanguardCallback(policy="raise", out=tmp_path / "run", config=QUIET)
    rec = ParamRecorder()
    with caplog.at_level("ERROR", logger="nanguard"):
        model, t = _fit([cb, rec], make_data(BATCH * STEPS, 2 * BATCH))
    assert t.should_stop and t.global_step < STEPS
    assert cb.report is not None and cb.report.first_nonfinite["step"] == 2
    assert cb.stopped and "stopped training at step 2" in cb.stopped
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "failed"
    assert [a["action"] for a in report["actions"]] == ["raise"]
    assert any("trainer.should_stop" in r.getMessage() for r in caplog.records)
    # The NaN batch's update was discarded: the parameters stay finite.
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_signals_reach_the_trainers_logger(tmp_path):
    """The step signals (NaN kept) and alarm counts land in the user's CSVLogger."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    logger = CSVLogger(tmp_path / "logs", name="x", version=0)
    _fit([cb], make_data(BATCH * STEPS, 5 * BATCH), logger=logger, log_every_n_steps=1)
    with open(tmp_path / "logs" / "x" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    grad = {int(r["step"]): r["nanguard/grad_norm"] for r in rows if r.get("nanguard/grad_norm")}
    assert len(grad) >= STEPS - 2
    assert float(grad[1]) > 0
    nonfinite = {int(r["step"]): float(r["nanguard/nonfinite"]) for r in rows
                 if r.get("nanguard/nonfinite")}
    first = min(s for s, v in nonfinite.items() if v == 1.0)
    # Lightning's step column counts completed steps: the row logged after step 5 is 5 or 6.
    assert first in (5, 6)
    assert any(r.get("nanguard/loss", "").lower() == "nan" for r in rows)
    assert sum(float(r.get("nanguard/alarms") or 0) for r in rows) >= 1


def test_error_in_training_is_recorded_as_crashed(tmp_path):
    class Boom(Regressor):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise RuntimeError("user bug")
            return super().training_step(batch, batch_idx)

    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    with pytest.raises(RuntimeError, match="user bug"):
        trainer([cb], STEPS).fit(Boom(), loader(make_data(BATCH * STEPS)))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "crashed"
    assert report["steps"] == 3


def test_state_round_trips_through_a_lightning_checkpoint(tmp_path):
    data = make_data(BATCH * STEPS, 4 * BATCH)
    cb = NanguardCallback(policy="skip", out=tmp_path / "run", config=QUIET)
    model = Regressor()
    t = trainer([cb], 6)
    t.fit(model, loader(data))
    ckpt = tmp_path / "a.ckpt"
    t.save_checkpoint(ckpt)
    # The guard's state is plain data: the checkpoint loads without pickle's arbitrary code.
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    (state,) = saved.values()
    assert state["guard"]["step"] == 6
    assert [(a["step"], a["action"]) for a in state["guard"]["actions"]] == [(4, "skip")]

    cb2 = NanguardCallback(policy="skip", config=QUIET)  # out from the checkpoint
    t2 = trainer([cb2], STEPS)
    t2.fit(Regressor(), loader(data), ckpt_path=ckpt)
    assert cb2.guard is not None
    assert cb2.guard.folder is not None and cb2.guard.folder.samefile(tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["steps"] == STEPS
    # The loader is not resumable: the resumed epoch starts again at batch 0, so the bad
    # batch comes back at step 6 + 4; the guard's step count went on from 6.
    assert [(a["step"], a["action"]) for a in report["actions"]] == [(4, "skip"), (10, "skip")]
    assert report["first_nonfinite"]["step"] == 4


def test_state_saved_mid_fit_by_model_checkpoint(tmp_path):
    """ModelCheckpoint saves after the step's update (on_train_batch_end): the guard's state in
    the step-6 checkpoint counts 6 steps and holds the step-4 skip, loadable without pickle."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = make_data(BATCH * STEPS, 4 * BATCH)
    cb = NanguardCallback(policy="skip", out=tmp_path / "run", config=QUIET)
    ckpts = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=6, save_top_k=-1)
    _fit([cb, ckpts], data, enable_checkpointing=True)
    (first, *_) = sorted((tmp_path / "ck").glob("*step=6*.ckpt"))
    saved = torch.load(first, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("NanguardCallback")]
    assert state["guard"]["step"] == 6
    assert [(a["step"], a["action"]) for a in state["guard"]["actions"]] == [(4, "skip")]


def test_bad_options_refused_at_construction():
    with pytest.raises(ValueError, match="unknown option"):
        NanguardCallback(polcy="skip")
    with pytest.raises(ValueError, match="policy"):
        NanguardCallback(policy="skipp")


def test_replay_with_several_optimizers_refused(tmp_path):
    """One replay function computes one loss: with two optimizers it is refused when fit
    starts (several optimizers are otherwise watched: test_lightning_gan.py)."""

    class Two(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                    torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    cb = NanguardCallback(out=tmp_path / "run", config=QUIET, replay=lambda b: b[0].sum())
    with pytest.raises(ValueError, match="replay= computes one loss"):
        trainer([cb], 2).fit(Two(), loader(make_data(BATCH * 2)))


def test_manifests_beside_model_checkpoints_and_verified_at_resume(tmp_path, caplog):
    """`manifests=True`: every checkpoint ModelCheckpoint writes gets its manifest (and loses
    it when rotated out: top-1 by step); one mantissa bit flipped in a weight of the kept
    checkpoint (still finite, found independently by comparing the weights) makes the resumed
    fit say so (an ERROR line) and record a `checkpoint_mismatch` alarm naming the tensor."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from nanguard.audit import verify_manifest

    data = make_data(BATCH * STEPS)
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET, manifests=True)
    ckpts = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4, save_top_k=1,
                            monitor="step", mode="max")
    _fit([cb, ckpts], data, enable_checkpointing=True)
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir())
    (ckpt,) = [tmp_path / "ck" / k for k in kept if k.endswith(".ckpt")]
    assert kept == sorted([ckpt.name, ckpt.name + ".nanguard-manifest.json"])  # rotated: gone
    assert verify_manifest(ckpt).ok

    state = torch.load(ckpt, weights_only=True)
    before = {k: v.clone() for k, v in state["state_dict"].items()}
    state["state_dict"]["net.0.weight"].view(torch.int32)[2, 3] ^= 1 << 3
    torch.save(state, ckpt)  # as a corrupting copy leaves it: the manifest is the old one
    after = torch.load(ckpt, weights_only=True)["state_dict"]
    assert [k for k in before if not before[k].equal(after[k])] == ["net.0.weight"]

    cb2 = NanguardCallback(out=tmp_path / "resumed", config=QUIET, manifests=True)
    with caplog.at_level("ERROR", logger="nanguard"):
        trainer([cb2], STEPS + 4).fit(Regressor(), loader(data), ckpt_path=ckpt)
    assert any("differs from its manifest" in r.getMessage() and "net.0.weight" in
               r.getMessage() for r in caplog.records)
    report = json.loads((tmp_path / "resumed" / "report.json").read_text())
    [alarm] = [a for a in report["alarms"] if a["kind"] == "checkpoint_mismatch"]
    assert "state_dict.net.0.weight" in alarm["message"] and report["status"] != "healthy"
