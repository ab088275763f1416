"""A small guarded run with a NaN row at step BAD under `skip`: what every exporter test writes
and reads back (the NaN loss at BAD, the nonfinite/skipped markers 1.0 there only, the alarm,
action and finding at BAD)."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig

BAD = 3
STEPS = 8


def nan_run(out: Path):
    """Train 8 steps of a tiny MLP with a NaN input row at step BAD; returns the guard's report."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, policy="skip", out=out,
                  config=GuardConfig(record=RecordConfig(summary=False)))
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if step == BAD:
            x[5, 1] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = guard.close()
    assert report.first_nonfinite is not None and report.first_nonfinite["step"] == BAD
    return report


def check_series(loss: dict[int, float], nonfinite: dict[int, float],
                 skipped: dict[int, float]) -> None:
    """The NaN loss is at BAD (not dropped, not replaced), every other step finite, and the 0/1
    markers are 1.0 at BAD only."""
    assert sorted(loss) == list(range(STEPS)), loss
    assert math.isnan(loss[BAD]), loss
    assert all(math.isfinite(v) for s, v in loss.items() if s != BAD), loss
    assert sorted(nonfinite) == list(range(STEPS))
    assert [s for s, v in sorted(nonfinite.items()) if v == 1.0] == [BAD], nonfinite
    assert [s for s, v in sorted(skipped.items()) if v == 1.0] == [BAD], skipped


def check_events(texts: dict[tuple[int, str], str]) -> None:
    """(step, kind) -> text: the alarm, skip, finding and diagnosis sit at BAD, the report last."""
    assert "nonfinite" in texts[(BAD, "alarms")]
    assert "skip" in texts[(BAD, "actions")]
    assert "data" in texts[(BAD, "first_nonfinite")]
    assert "data_nonfinite" in texts[(BAD, "diagnosis")]
    assert "status: " in texts[(STEPS - 1, "report")]
    assert [k for k in texts if k[1] == "actions"] == [(BAD, "actions")]


WANDB_BLOCK = 32768  # the W&B log's block size; a record header is crc32 (4), length (2), type (1)


def wandb_records(path: Path):
    """The protobuf `Record`s of a W&B transaction log (`run-<id>.wandb`: LevelDB-style blocks,
    parsed with W&B's own protobuf classes; the SDK ships no reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            return
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full record, or last fragment of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_wandb(folder: Path, done=lambda rows, summary: True, wait: float = 30.0):
    """A W&B run folder's history rows (dicts of raw JSON texts, in log order), summary (key ->
    JSON text) and alerts (titles). W&B's writer is a service process of its own: on a loaded
    machine its last records may reach the file a moment after `log()` or `finish()` returned,
    so it is read again until `done(rows, summary)` or `wait` seconds."""
    [log] = folder.glob("run-*.wandb")
    deadline = time.monotonic() + wait
    while True:
        rows, summary, alerts = [], {}, []
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({_key(i): i.value_json for i in record.history.item})
            elif kind == "summary":
                summary.update({_key(i): i.value_json for i in record.summary.update})
            elif kind == "alert":
                alerts.append(record.alert.title)
        if done(rows, summary) or time.monotonic() > deadline:
            return rows, summary, alerts
        time.sleep(0.2)


def wandb_series(rows, name: str) -> dict[int, float]:
    """nanguard/step -> value of `nanguard/<name>` in W&B history rows."""
    return {int(json.loads(r["nanguard/step"])): float(json.loads(r[f"nanguard/{name}"]))
            for r in rows if f"nanguard/{name}" in r}


# -- live: the cascade streamed while it trains
SPIKE, NAN_AT, CASCADE_STEPS = 10, 15, 30
"""`make_cascade(0, steps=30, outlier_at=10)`: a spike at step 10, its loss Inf at step 15 and
NaN after (no policy acts: `observe`)."""


def cascade_live(out: Path, stream, during=None, at: int = NAN_AT):
    """Train the cascade under a guard recording to `out`, `stream(guard)` subscribing an
    exporter first; `during(stream)` runs inside a step listener added after it at step `at`
    (what the tracker holds by then is what arrived live). Returns (stream, report, what
    `during` returned)."""
    from nanguard.scenarios.cascade import make_cascade

    setup = make_cascade(0, steps=CASCADE_STEPS, outlier_at=SPIKE)
    guard = Guard(setup.model, setup.optimizer, policy="observe", out=out,
                  config=GuardConfig(record=RecordConfig(summary=False)))
    handle = stream(guard)
    seen = []
    if during is not None:
        def check(event):
            if event.step == at:
                seen.append(during(handle))
        guard.add_listener(check, only="step")
    for x, y in setup.batches:
        loss = setup.loss_fn(setup.model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        setup.optimizer.zero_grad()
        loss.backward()
        setup.optimizer.step()
    report = guard.close()
    assert report.status == "failed" and report.first_nonfinite["step"] == NAN_AT
    assert not guard.events.errors, guard.events.errors  # no exporter listener failed
    return handle, report, seen[0] if seen else None


def check_cascade(loss: dict[int, float], nonfinite: dict[int, float], until: int = 29) -> None:
    """Steps 0..until: finite loss before NAN_AT, Inf at it, NaN after; nonfinite 1.0 from
    NAN_AT on."""
    assert sorted(loss) == list(range(until + 1)), sorted(loss)
    assert all(math.isfinite(loss[s]) for s in range(NAN_AT)), loss
    assert loss[NAN_AT] == math.inf, loss
    assert all(math.isnan(loss[s]) for s in range(NAN_AT + 1, until + 1)), loss
    assert [s for s, v in sorted(nonfinite.items()) if v == 1.0] == \
        list(range(NAN_AT, until + 1)), nonfinite


def check_cascade_events(texts: dict[tuple[int, str], str], closed: bool = True) -> None:
    """(step, kind) -> text: the spike at SPIKE, the non-finite alarms at NAN_AT; once closed,
    the finding and diagnosis at NAN_AT and the failed report at the last step."""
    assert "spike" in texts[(SPIKE, "alarms")], texts
    assert "nonfinite" in texts[(NAN_AT, "alarms")] and "`loss`" in texts[(NAN_AT, "alarms")]
    if closed:
        assert "optimizer_divergence" in texts[(NAN_AT, "first_nonfinite")]
        assert "optimizer_divergence" in texts[(NAN_AT, "diagnosis")]
        assert "status: failed" in texts[(CASCADE_STEPS - 1, "report")]
