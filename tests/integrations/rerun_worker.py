"""One rank of the DDP re-run test:
`python rerun_worker.py OUT RANK PORT MODE [POLICY] [CROSS]`.

Two gloo ranks train a DDP MLP under `Guard(replay=..., policy=POLICY)` (default `observe`).
At step 25, on rank 1 alone: `data` scales its batch by 300 (a real spike the same batch gives
again), `flip` flips the top exponent bit of one output of the last layer in its forward, once
(a transient fault), `persistent` flips the top exponent bit of one output of the last layer in
every forward from then on, re-runs included (a faulty device). The gradients are averaged
across ranks, so both ranks see the spike and re-run their own batch before the update; with
CROSS (`1`, the default; `0`: off, `DetectConfig.cross_rank_rerun`; `none`: no replay at all,
nothing re-runs) rank 1's batch is re-run on rank 0 too. The MLP has a BatchNorm, whose
buffers DDP broadcasts before every training forward (a replay must neither run nor skip that
broadcast). Prints one `RESULT {json}` line: the alarms, each spike's re-run, the diagnosis,
and a hash of the final parameters' and buffers' bytes (training must not depend on CROSS).

Ends with os._exit so that interpreter teardown does not count against the test's time.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nanguard import DetectConfig, Guard, GuardConfig, RecordConfig
from nanguard.testing import FaultInjector

STEPS, AT = 30, 25


def main() -> None:
    out, rank, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    policy = sys.argv[5] if len(sys.argv) > 5 else "observe"
    cross = sys.argv[6] if len(sys.argv) > 6 else "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    guard = Guard(model, opt, out=os.path.join(out, f"rank-{rank}"),
                  replay=None if cross == "none" else loss_of,
                  config=GuardConfig(policy=policy, record=RecordConfig(summary=False),
                                     detect=DetectConfig(cross_rank_rerun=cross == "1")))
    torch.manual_seed(100 + rank)
    with FaultInjector(model, opt, seed=0) as inj:
        flip = (inj.flip_activation("module.3", step=AT, bit=30, rank=1) if mode == "flip"
                else inj.flip_activation("module.3", step=AT, bit=30, rank=1, persistent=True)
                if mode == "persistent" else None)
        for step in range(STEPS):
            x = torch.randn(16, 8)
            if mode == "data" and step == AT and rank == 1:
                x = x * 300
            batch = (x, x.sum(1, keepdim=True))
            loss = loss_of(batch)
            guard.watch(loss=loss, batch=batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = guard.close()
    print("RESULT " + json.dumps({
        "alarms": [(a["step"], a["kind"]) for a in report.alarms],
        "reruns": [(sp["step"], sp.get("rerun")) for sp in report.spikes],
        "causes": [c["cause"] for c in report.diagnosis],
        "fired": bool(flip and flip.fired), "flip": str(flip),
        "first": report.first_nonfinite,
        "params": hashlib.sha256(b"".join(
            t.detach().numpy().tobytes() for t in [*model.parameters(), *model.buffers()])
        ).hexdigest(),
        "evidence": {c["cause"]: c["evidence"] for c in report.diagnosis},
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
