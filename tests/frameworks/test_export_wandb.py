"""W&B exporter (`nanguard.export.wandb.write_run`) in offline mode, read back from the run's
own transaction log (`run-<id>.wandb`: W&B's LevelDB-style record log of protobuf `Record`s,
parsed here with W&B's own protobuf classes; the SDK no longer ships a reader): the NaN loss is
stored at its step as "NaN" (not dropped, not replaced), the 0/1 nonfinite/skipped series mark
that step only, the events panel at that step holds the alarm, action and finding, and the
summary names the first non-finite step and top cause. Nothing leaves the machine."""

from __future__ import annotations

import json
import math
import struct
import time

import pytest

pytest.importorskip("wandb")

from export_rig import BAD, STEPS, check_events, check_series, nan_run  # noqa: E402
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

from nanguard.export.wandb import write_run  # noqa: E402

BLOCK = 32768  # the log's block size; a record header is crc32 (4), length (2), type (1)


def _records(path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full record, or last fragment of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _key(item):
    return item.key or "/".join(item.nested_key)


def test_nan_step_kept_and_marked(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    nan_run(tmp_path / "run")
    [folder] = write_run(tmp_path / "run", mode="offline")
    assert folder.name.startswith("offline-run-") and folder.parent == tmp_path / "run" / "wandb"
    [log] = folder.glob("run-*.wandb")
    # W&B's writer is a service process of its own: on a loaded machine its last records may
    # reach the file a moment after `run.finish()` returned. Read until the summary is there.
    deadline = time.monotonic() + 30
    while True:
        history, raw, summary = {}, {}, {}
        for record in _records(log):
            if record.WhichOneof("record_type") == "history":
                step = record.history.step.num
                raw[step] = {_key(i): i.value_json for i in record.history.item}
                history[step] = {k: json.loads(v) for k, v in raw[step].items()}
            elif record.WhichOneof("record_type") == "summary":
                summary.update({_key(i): i.value_json for i in record.summary.update})
        if len(history) == STEPS and "nanguard/top_cause" in summary \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    def series(name):
        return {s: float(h[f"nanguard/{name}"]) for s, h in history.items()
                if f"nanguard/{name}" in h}

    loss = series("loss")
    assert raw[BAD]["nanguard/loss"] == "NaN"  # stored as NaN, not a running average
    check_series(loss, series("nonfinite"), series("skipped"))
    assert all(math.isfinite(loss[s]) for s in loss if s != BAD)
    # media are nested keys: ("nanguard/events", "path") -> the file under the run's files/
    panels = {s: h["nanguard/events/path"] for s, h in history.items()
              if "nanguard/events/path" in h}
    assert sorted(panels) == [BAD, STEPS - 1]
    texts = {}  # (step, kind) -> text (html-escaped; the checks' words have nothing to escape)
    for step, panel in panels.items():
        page = (folder / "files" / panel).read_text()
        for part in page.split("<h3>")[1:]:
            kind, text = part.split("</h3>", 1)
            texts[(step, kind)] = text
    check_events(texts)
    table = json.loads((folder / "files" / history[STEPS - 1]["nanguard/event_table/path"])
                       .read_text())
    assert [BAD, "first_nonfinite"] in [row[:2] for row in table["data"]]
    assert json.loads(summary["nanguard/first_nonfinite_step"]) == BAD
    assert json.loads(summary["nanguard/top_cause"]) == "data_nonfinite"
