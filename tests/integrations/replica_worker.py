"""One rank of the replica-agreement test: `python replica_worker.py OUT RANK PORT [MODE]`.

Two gloo ranks train a DDP MLP under a Guard that compares the replicas every 4 steps. On
rank 1 alone, the fault injector flips the LOWEST mantissa bit of one element of the first
layer's weight after step 5: numerically harmless (no loss jump, no detector could see it),
but the replicas no longer agree. With `standdown`, rank 0's guard stands down (as after an
internal error) at step 2: the ranks must stay in lockstep all the same. With `rank0only`,
rank 1 builds no Guard: rank 0's check must turn itself off, not wait for it. With `step0`,
the flip (rank 1, the lowest mantissa bit) lands within step 0 itself, before the check after
step 0's update reads the parameters (the injector's hook runs first); with `prestart`, rank 1's
parameter changes after DDP broadcast it and before the first update (no injector: an
in-place write). Prints one `RESULT {json}` line: the alarms and the flip.

Ends with os._exit so that interpreter teardown does not count against the test's time.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nanguard import DetectConfig, Guard, GuardConfig, RecordConfig
from nanguard.testing import FaultInjector

STEPS, FLIP_STEP, EVERY = 14, 5, 4


def main() -> None:
    out, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "plain"
    # `-skip`, `-rollback`, `-raise`: an acting policy, whose per-step agreement the check's
    # fingerprint rides.
    mode, _, policy = mode.partition("-")
    policy = policy or "observe"
    stand_down = mode == "standdown" and rank == 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = GuardConfig(
        detect=DetectConfig(replica_every=EVERY), record=RecordConfig(summary=False)
    )
    # `step0`: the injector hooks the optimizer before the guard, so its flip after step 0's
    # update comes before the replica check's read of that update.
    inj = FaultInjector(model, opt, seed=0).install() if mode == "step0" else None
    guard = None
    # `late`: rank 1 builds its guard inside its first step, after the backward and a pause,
    # as `nanguard run` does (the guard attaches at the first `optimizer.step()`): rank 0
    # reaches its check before rank 1 has registered one.
    late = mode == "late" and rank == 1
    if mode == "rank0only" and rank == 0:
        # Rank 1 never registers, so rank 0 sits out the whole registration wait (10 s by
        # default) before turning its check off; 2 s runs the same path (the store's wait
        # times out) 8 s sooner.
        from nanguard.watch import replicas

        replicas.ranks_without_check.__defaults__ = (2.0,)
    if not (mode == "rank0only" and rank == 1) and not late:
        guard = Guard(model, opt, out=os.path.join(out, f"rank-{rank}"), config=config,
                      policy=policy)
    if mode == "prestart" and rank == 1:
        with torch.no_grad():  # after DDP's broadcast, before any update: a fault, not a layout
            w = model.module[0].weight
            w.view(-1).view(torch.int32)[3] ^= 1
    torch.manual_seed(100 + rank)  # each rank its own data
    with inj or FaultInjector(model, opt, seed=0) as inj:
        flip = inj.flip_param("module.0.weight", step=0 if mode == "step0" else FLIP_STEP,
                              bit=0, rank=1 if mode != "prestart" else 99)
        for step in range(STEPS):
            if stand_down and guard and step == 2:
                guard.stand_down(RuntimeError("injected by the test"), "test")
            x = torch.randn(16, 8)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            if guard:
                guard.watch(loss=loss)
            opt.zero_grad()
            loss.backward()
            if late and guard is None:
                time.sleep(1.5)
                guard = Guard(model, opt, out=os.path.join(out, f"rank-{rank}"),
                              config=config, policy=policy)
            opt.step()
    result = {"alarms": [], "checks": 0, "error": None, "causes": []}
    if guard:
        guard.close()
        result = {
            "alarms": [a.to_dict() for a in guard.alarms],
            "checks": guard.replicas.checks if guard.replicas else 0,
            "rode": guard.replicas.rode if guard.replicas else 0,
            "error": guard.error,
            "causes": [c["cause"] for c in guard.report.diagnosis] if guard.report else [],
        }
    result["flip"] = {"fired": flip.fired, "index": flip.index, "old": flip.old, "new": flip.new}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
