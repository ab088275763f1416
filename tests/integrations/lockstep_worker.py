"""One rank of the lockstep stand-down test:
`python lockstep_worker.py OUT RANK PORT WHERE [POLICY]`.

Two gloo ranks train a DDP MLP under `skip` (so every step's decision is agreed across ranks in
one all-reduce), or under `observe` with a replay (the ranks agree before every update whether
to re-run a rank's batch across ranks, `pinpoint.xrank`). At step 3, rank 0 alone hits an
internal error of nanguard's own, WHERE: `pre` (in its optimizer pre-hook, before the step's
agreement) or `post` (in its post-hook, before the next agreement). Both ranks must finish
every step: nobody waits in a collective the other will never join. Prints one `RESULT {json}` line.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nanguard import DetectConfig, Guard, GuardConfig, RecordConfig

STEPS, BREAK_AT = 10, 3


def main() -> None:
    out, rank, port, where = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    policy = sys.argv[5] if len(sys.argv) > 5 else "skip"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    # `pre` runs every detector's full test (no quiet gate): the pre-update detectors' `check`
    # is then called on every path of the pre-hook, before the step's agreement.
    guard = Guard(model, opt, policy=policy, out=os.path.join(out, f"rank-{rank}"),
                  config=GuardConfig(record=RecordConfig(summary=False),
                                     detect=DetectConfig(quiet_gate=where != "pre")),
                  replay=(lambda x: nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
                  if policy == "observe" else None)
    if rank == 0:  # an internal error of nanguard's own, at one step, on one rank
        # "pre": a pre-update detector's test, which the pre-hook runs on every path (the
        # quiet lane's and the packet path's) before the step's agreement. "post": the step's
        # row in the record (`guard.store.write_step`), written in the post-hook before the
        # post-update agreement (the next step's, under `observe`).
        owner: object
        if where == "pre":
            owner, name = next(d for d in guard.detectors if d.phase == "pre"), "check"
        else:
            owner, name = guard.store, "write_step"
        target = getattr(owner, name)

        def broken(*args: object, **kwargs: object) -> object:
            at = guard.step if where == "pre" else args[0]["step"]  # type: ignore[index]
            if at == BREAK_AT:
                raise RuntimeError("injected internal error")
            return target(*args, **kwargs)

        setattr(owner, name, broken)
    torch.manual_seed(100 + rank)
    done = 0
    for _ in range(STEPS):
        x = torch.randn(16, 8)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        guard.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
    report = guard.close()
    print("RESULT " + json.dumps({"steps": done, "status": report.status, "error": guard.error,
                                  "recorded": report.steps}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
