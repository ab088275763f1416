"""transformers adapter (`nanguard.integrations.transformers`) with a real `Trainer` on CPU and a
2-layer GPT-2 built from a config (random init, nothing downloaded), fed float `inputs_embeds`
so a data row can hold a NaN. Covers: a healthy run (healthy, bitwise untouched); a NaN row found
at its step and row although the Trainer's logging_nan_inf_filter hides the NaN loss, with the
same findings as a plain-loop Guard; `skip` discarding exactly that update; the
`NanguardTrainer` wrapper (loss from compute_loss, guard closed when train() raises)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from hf_rig import BATCH, QUIET, VOCAB, Embeds, make_args, make_model, train  # noqa: E402

from nanguard import Guard  # noqa: E402
from nanguard.integrations.transformers import (  # noqa: E402
    NanguardCallback,
    NanguardTrainer,
)


def test_healthy_run_is_healthy_and_bitwise_untouched(tmp_path):
    data = Embeds(BATCH * 6)
    plain, _ = train(tmp_path, 6, data)
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    watched, _ = train(tmp_path, 6, data, [cb])
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "healthy"
    assert report["steps"] == 6
    assert report["run"]["entry"] == "transformers"


def _plain_guard_report(tmp_path, data, steps):
    """The same model, data order and optimizer in a plain loop under Guard."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, out=tmp_path / "plain", config=QUIET)
    for s in range(steps):
        batch = {k: torch.stack([data[i][k] for i in range(s * BATCH, (s + 1) * BATCH)])
                 for k in ("inputs_embeds", "labels")}
        loss = model(**batch).loss
        guard.watch(loss=loss, batch=batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return guard.close()


def test_nan_row_found_although_the_trainer_filters_the_loss(tmp_path):
    steps, bad_step, row = 6, 3, 2
    data = Embeds(BATCH * steps, bad_step * BATCH + row)
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    _, trainer = train(tmp_path, steps, data, [cb])
    # The Trainer's own log shows no NaN at the bad step (logging_nan_inf_filter).
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(logged[bad_step])
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "failed"
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"]) == (bad_step, "data")
    assert row in first["samples"]
    assert "loss" in first["signals"]
    assert report["diagnosis"][0]["cause"] == "data_nonfinite"
    plain = _plain_guard_report(tmp_path, data, steps)
    assert plain.first_nonfinite is not None
    for key in ("step", "phase", "samples"):
        assert first[key] == plain.first_nonfinite[key], key
    assert report["diagnosis"][0]["cause"] == plain.diagnosis[0]["cause"]


def test_skip_discards_exactly_that_update(tmp_path):
    steps, bad_step = 8, 4
    seen: list[list[torch.Tensor]] = []

    class Rec(NanguardCallback.__mro__[1]):  # a plain TrainerCallback
        def on_step_end(self, args, state, control, model=None, **kw):
            seen.append([p.detach().clone() for p in model.parameters()])

    cb = NanguardCallback(policy="skip", out=tmp_path / "run", config=QUIET)
    model, _ = train(tmp_path, steps, Embeds(BATCH * steps, bad_step * BATCH + 1), [cb, Rec()])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for a, b in zip(seen[bad_step - 1], seen[bad_step], strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b)
               for a, b in zip(seen[bad_step], seen[bad_step + 1], strict=True))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [(a["step"], a["action"]) for a in report["actions"]] == [(bad_step, "skip")]
    assert report["steps"] == steps


def test_nanguard_trainer_takes_the_loss_from_compute_loss(tmp_path):
    """A custom compute_loss (the model gets no labels, so its output has no loss)."""

    class Custom(NanguardTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     labels.reshape(-1))
            return (loss, logits) if return_outputs else loss

    steps, bad_step = 5, 2
    data = Embeds(BATCH * steps, bad_step * BATCH)
    trainer = Custom(model=make_model(), args=make_args(tmp_path, steps), train_dataset=data,
                     nanguard={"policy": "skip", "out": tmp_path / "run", "config": QUIET})
    trainer.train()
    report = trainer.nanguard_callback.report
    assert report is not None
    assert report.first_nonfinite is not None and "loss" in report.first_nonfinite["signals"]
    assert [(a["step"], a["action"]) for a in report.actions] == [(bad_step, "skip")]


def test_nanguard_trainer_closes_the_guard_when_train_raises(tmp_path):
    class Boom(NanguardTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.state.global_step == 2:
                raise RuntimeError("user bug")
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Boom(model=make_model(), args=make_args(tmp_path, 5), train_dataset=Embeds(20),
                   nanguard={"out": tmp_path / "run", "config": QUIET})
    with pytest.raises(RuntimeError, match="user bug"):
        trainer.train()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "crashed"
    assert report["steps"] == 2


def test_bad_options_refused_at_construction():
    with pytest.raises(ValueError, match="unknown option"):
        NanguardCallback(polcy="skip")
    with pytest.raises(ValueError, match="policy"):
        NanguardCallback(policy="skipp")


def test_raise_stops_train_the_trainers_way(tmp_path, caplog):
    """`raise` ends train() without a traceback: the report is written, the failing update is
    not applied, control.should_training_stop is set and a log line says why."""
    steps, bad_step = 6, 2
    cb = NanguardCallback(policy="raise", out=tmp_path / "run", config=QUIET)
    with caplog.at_level("ERROR", logger="nanguard"):
        model, trainer = train(tmp_path, steps, Embeds(BATCH * steps, bad_step * BATCH), [cb])
    assert trainer.state.global_step == bad_step + 1  # the Trainer stopped after that step
    assert cb.stopped and f"stopped training at step {bad_step}" in cb.stopped
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "failed" and report["first_nonfinite"]["step"] == bad_step
    assert [a["action"] for a in report["actions"]] == ["raise"]
    assert any("should_training_stop" in r.getMessage() for r in caplog.records)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_signals_join_the_trainers_logs(tmp_path):
    """on_log: nanguard's signals in state.log_history, the NaN loss kept (the Trainer's own
    `loss` is filtered by logging_nan_inf_filter)."""
    steps, bad_step = 5, 2
    cb = NanguardCallback(out=tmp_path / "run", config=QUIET)
    _, trainer = train(tmp_path, steps, Embeds(BATCH * steps, bad_step * BATCH), [cb])
    logs = {e["step"]: e for e in trainer.state.log_history if "nanguard/grad_norm" in e}
    assert sorted(logs) == list(range(1, steps + 1))
    # The entry logged after step k (global_step k + 1) holds step k's signals.
    assert logs[bad_step + 1]["nanguard/nonfinite"] == 1.0
    assert math.isnan(logs[bad_step + 1]["nanguard/loss"])
    assert logs[bad_step]["nanguard/nonfinite"] == 0.0
    assert sum(e["nanguard/alarms"] for e in logs.values()) >= 1
