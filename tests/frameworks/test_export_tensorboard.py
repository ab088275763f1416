"""TensorBoard exporter (`nanguard.export.tensorboard.write_run`): a run with a NaN row at a
known step, under `skip`, written and read back with TensorBoard's own EventAccumulator: the NaN
loss is there at that step (not dropped, not replaced), the nonfinite/skipped markers are 1.0
there only, and the alarm, action and finding text events sit at that step. Importing the export
package and its exporters imports no tracker."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from helpers import child_env  # noqa: E402
from nanguard import Guard, GuardConfig, RecordConfig  # noqa: E402
from nanguard.export.tensorboard import write_run  # noqa: E402

BAD = 3


def _run(out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, policy="skip", out=out,
                  config=GuardConfig(record=RecordConfig(summary=False)))
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if step == BAD:
            x[5, 1] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard.close()


def _texts(acc, tag):
    # torch.utils.tensorboard stores add_text(tag) as a text-plugin tensor "tag/text_summary".
    return {e.step: e.tensor_proto.string_val[0].decode()
            for e in acc.Tensors(f"{tag}/text_summary")}


def test_nan_step_kept_and_marked(tmp_path):
    report = _run(tmp_path / "run")
    assert report.first_nonfinite is not None and report.first_nonfinite["step"] == BAD
    logdir = write_run(tmp_path / "run")
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("nanguard/loss")}
    assert sorted(loss) == list(range(8))
    assert math.isnan(loss[BAD])
    assert all(math.isfinite(v) for s, v in loss.items() if s != BAD)
    marks = {e.step: e.value for e in acc.Scalars("nanguard/nonfinite")}
    assert [s for s, v in marks.items() if v == 1.0] == [BAD]
    skipped = {e.step: e.value for e in acc.Scalars("nanguard/skipped")}
    assert [s for s, v in skipped.items() if v == 1.0] == [BAD]
    alarms = _texts(acc, "nanguard/alarms")
    assert BAD in alarms and "nonfinite" in alarms[BAD]
    actions = _texts(acc, "nanguard/actions")
    assert list(actions) == [BAD] and "skip" in actions[BAD]
    first = _texts(acc, "nanguard/first_nonfinite")
    assert list(first) == [BAD] and "data" in first[BAD]
    assert "data_nonfinite" in _texts(acc, "nanguard/diagnosis")[BAD]
    assert "status: " in _texts(acc, "nanguard/report")[7]


def test_not_a_run_refused(tmp_path):
    with pytest.raises(ValueError, match="not a nanguard run folder"):
        write_run(tmp_path)


def test_importing_export_imports_no_tracker():
    code = ("import sys, nanguard, nanguard.export, nanguard.export.tensorboard, "
            "nanguard.export.mlflow, nanguard.export.wandb, nanguard.export.trackio; "
            "print([m for m in ('tensorboard', 'torch.utils.tensorboard', 'wandb', 'mlflow', "
            "'trackio') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=child_env()).stdout.strip()
    assert out == "[]"


def _read(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("nanguard/loss")}
    marks = {e.step: e.value for e in acc.Scalars("nanguard/nonfinite")}
    texts = {(s, tag.split("/")[1]): t for tag in acc.Tags()["tensors"]
             for s, t in _texts(acc, tag.removesuffix("/text_summary")).items()}
    return loss, marks, texts


def test_stream_live(tmp_path):
    """The cascade streamed into a log dir: by the NaN step's listener its Inf loss, its
    nonfinite mark and its alarm are on disk already; at close the finding and the report."""
    from export_rig import NAN_AT, cascade_live, check_cascade, check_cascade_events

    from nanguard.export.tensorboard import stream

    logdir = tmp_path / "tb"
    handle, _, (loss, marks, texts) = cascade_live(
        tmp_path / "run", lambda g: stream(g, log_dir=logdir), lambda _: _read(logdir))
    check_cascade(loss, marks, until=NAN_AT)  # live: written before the run went on
    check_cascade_events(texts, closed=False)
    assert (NAN_AT, "first_nonfinite") not in texts  # told at close
    loss, marks, texts = _read(logdir)
    check_cascade(loss, marks)
    check_cascade_events(texts)
    assert handle.closed and handle.owned


def test_stream_into_users_writer(tmp_path):
    """A SummaryWriter of the user's: nanguard's series land in it next to the user's own,
    and it stays open after the guard closes."""
    from export_rig import cascade_live, check_cascade
    from torch.utils.tensorboard import SummaryWriter

    from nanguard.export.tensorboard import stream

    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    writer.add_scalar("my/loss", 1.0, 0)
    handle, _, _ = cascade_live(tmp_path / "run", lambda g: stream(g, writer=writer))
    writer.add_scalar("my/loss", 2.0, 30)  # still open
    writer.close()
    assert handle.writer is writer and not handle.owned
    loss, marks, _ = _read(tmp_path / "mine")
    check_cascade(loss, marks)
    acc = EventAccumulator(str(tmp_path / "mine"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("my/loss")] == [1.0, 2.0]
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name == "tensorboard"] == []


def test_stream_refuses(tmp_path):
    from nanguard.export.tensorboard import stream

    model = nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), out=tmp_path / "r",
                  config=GuardConfig(record=RecordConfig(summary=False)))
    with pytest.raises(ValueError, match="not both"):
        stream(guard, log_dir=tmp_path, writer=object())
    guard.close()
    with pytest.raises(ValueError, match="closed"):
        stream(guard, log_dir=tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_stream_closed_early(tmp_path):
    """`close()` on the stream mid-run: what it wrote stays, later steps are not written, the
    guard goes on and closes as usual."""
    from export_rig import cascade_live

    from nanguard.export.tensorboard import stream

    logdir = tmp_path / "tb"
    handle, report, _ = cascade_live(tmp_path / "run", lambda g: stream(g, log_dir=logdir),
                                     lambda h: h.close(), at=12)
    handle.close()  # again: nothing
    loss, marks, texts = _read(logdir)
    assert sorted(loss) == list(range(13)) and (12, "alarms") in texts
    assert report.steps == 30


def test_stream_under_raise(tmp_path):
    """Under `raise` the run stops at the non-finite step (an exception through the user's
    `with guard:`): that step, its alarms, the raise action and the report still reach the
    event files as the guard closes."""
    from export_rig import NAN_AT, SPIKE

    from nanguard.errors import NanguardError
    from nanguard.export.tensorboard import stream
    from nanguard.scenarios.cascade import make_cascade

    setup = make_cascade(0, steps=30, outlier_at=SPIKE)
    guard = Guard(setup.model, setup.optimizer, policy="raise", out=tmp_path / "run",
                  config=GuardConfig(record=RecordConfig(summary=False)))
    stream(guard, log_dir=tmp_path / "tb")
    with pytest.raises(NanguardError), guard:
        for x, y in setup.batches:
            loss = setup.loss_fn(setup.model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            setup.optimizer.zero_grad()
            loss.backward()
            setup.optimizer.step()
    loss, _, texts = _read(tmp_path / "tb")
    assert max(loss) == NAN_AT and math.isinf(loss[NAN_AT])  # recorded as the guard closed
    assert "nonfinite" in texts[(NAN_AT, "alarms")]
    assert "raise" in texts[(NAN_AT, "actions")]
    assert "status: failed" in [t for (s, k), t in texts.items() if k == "report"][0]
