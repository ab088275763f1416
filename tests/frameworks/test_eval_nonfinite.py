"""A NaN in evaluation only: a validation set with a NaN row (Lightning) and an evaluation set
with one (the transformers Trainer). Training is clean, so its values stay finite; the logged
evaluation metric is NaN (checked here from the framework's own metrics, not nanguard's). The
run must not read `healthy` with nothing said: one `eval_nonfinite` alarm, said live, status
`warned`, and the training bitwise as without nanguard."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

from lightning_rig import BATCH, Regressor, loader, make_data, trainer  # noqa: E402

from nanguard import GuardConfig, RecordConfig  # noqa: E402

QUIET = GuardConfig(record=RecordConfig(summary=False))


class _Validated(Regressor):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))


def _fit(callbacks, val_bad_row):
    model = _Validated()
    t = trainer(callbacks, 12, val_check_interval=4, num_sanity_val_steps=0)
    t.fit(model, loader(make_data(BATCH * 12)), loader(make_data(BATCH * 3, val_bad_row, seed=1)))
    return model, t


def test_lightning_validation_nan_is_said_once_and_the_run_warned(tmp_path, caplog):
    from nanguard.integrations.lightning import NanguardCallback

    plain, t_plain = _fit([], val_bad_row=5)
    assert math.isnan(float(t_plain.callback_metrics["val_loss"]))  # the framework's own
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        watched, _ = _fit([cb], val_bad_row=5)
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    evals = [a for a in report["alarms"] if a["kind"] == "eval_nonfinite"]
    assert [a["signal"] for a in evals] == ["metric:val_loss"]  # 3 validations, said once
    assert report["status"] == "warned" and report["first_nonfinite"] is None
    assert any("eval_nonfinite" in r.getMessage() for r in caplog.records)
    clean = NanguardCallback(out=tmp_path / "clean", config=QUIET)
    _fit([clean], val_bad_row=None)
    assert clean.report is not None and clean.report.status == "healthy"


def test_transformers_eval_loss_nan_is_an_alarm(tmp_path):
    pytest.importorskip("transformers")
    from hf_rig import BATCH as HF_BATCH
    from hf_rig import Embeds, make_args, make_model
    from transformers import Trainer

    from nanguard.integrations.transformers import NanguardCallback

    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    t = Trainer(model=make_model(), args=make_args(tmp_path, 4, eval_strategy="steps",
                                                   eval_steps=2),
                train_dataset=Embeds(HF_BATCH * 4), eval_dataset=Embeds(HF_BATCH, 1),
                callbacks=[cb])
    t.train()  # two evaluations inside training: said once
    evals_logged = [h["eval_loss"] for h in t.state.log_history if "eval_loss" in h]
    assert len(evals_logged) == 2 and all(math.isnan(v) for v in evals_logged)  # the Trainer's
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    evals = [a for a in report["alarms"] if a["kind"] == "eval_nonfinite"]
    assert [a["signal"] for a in evals] == ["metric:eval_loss"], report["alarms"]
