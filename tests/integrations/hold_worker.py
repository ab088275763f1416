"""One rank of the agreed-hold test: `python hold_worker.py OUT RANK PORT SCENARIO`.

Two gloo ranks train a DDP MLP under `skip` (`policy.recurrence`: a spike of a recurring
instability keeps its update, a bad batch's is discarded), SCENARIO:

- `ramp`: the SGD LR ramps past the MLP's stability limit, as in
  `tests/policy/test_skip_acts_for_the_cause.py`: the averaged gradient spikes on both ranks
  alike, step after step.
- `bad`: the LR stays put; at steps `BAD` rank 1 alone draws a batch whose rows come from a
  corrupted region (8 of 32 rows with a target of 30). Its loss is an outlier on rank 1 only; the
  averaged gradient spikes on both ranks.

Prints one `RESULT {json}` line: the steps of the rank's skips and holds, its spike alarms, and
a fingerprint of its parameters at the end (the replicas must be equal).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nanguard import Guard, GuardConfig, RecordConfig

STEPS, RAMP_TO, BAD = 140, 0.5, (60, 70)


def main() -> None:
    out, rank, port, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    guard = Guard(model, opt, policy="skip", out=os.path.join(out, f"rank-{rank}"),
                  config=GuardConfig(record=RecordConfig(summary=False)))
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(10 + rank)
    for i in range(STEPS):
        if scenario == "ramp":
            lr = 0.01 + (RAMP_TO - 0.01) * min(1.0, i / 100) if i < 112 else 0.02
        else:
            lr = 0.05
        for group in opt.param_groups:
            group["lr"] = lr
        x = torch.randn(32, 8, generator=gen)
        y = x @ w
        if scenario == "bad" and rank == 1 and i in BAD:
            y = y.clone()
            y[:8] = 30.0  # rows from a corrupted region: their targets are garbage
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    guard.close()
    report = json.loads(Path(out, f"rank-{rank}", "report.json").read_text())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print("RESULT " + json.dumps({
        "rank": rank,
        "skips": [a["step"] for a in report["actions"] if a["action"] == "skip"],
        "held": [a["step"] for a in report["actions"] if a["action"] == "not_skipped"],
        "details": {a["step"]: a["detail"] for a in report["actions"]},
        "spikes": sorted({a["step"] for a in report["alarms"] if a["kind"] == "spike"}),
        "bad": sorted({s["step"] for s in report.get("spikes", [])
                       if s.get("cause") == "bad_batch"}),
        "params": digest}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
