"""Data-parallel training with torchrun on CPU (gloo): DDP, or FSDP2 with `--fsdp`.

Run:  torchrun --nproc-per-node 2 examples/ddp_torchrun.py
      torchrun --nproc-per-node 2 -m nanguard run --policy skip \\
          examples/ddp_torchrun.py --poison-step 12 --poison-rank 1
`--poison-step N --poison-rank R` puts a NaN into one sample of rank R's batch N only: under
DDP the gradient all-reduce then spreads it to every rank in the same step.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--poison-step", type=int, default=-1)
    p.add_argument("--poison-rank", type=int, default=1)
    p.add_argument("--poison-sample", type=int, default=3)
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model: nn.Module = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(),
                                     nn.Linear(48, 1))
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    w = torch.randn(12, 1, generator=torch.Generator().manual_seed(7))
    loss = torch.zeros(())
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 12, generator=gen)
        y = x @ w
        if step == args.poison_step and rank == args.poison_rank:
            x[args.poison_sample, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"done: {args.steps} steps on {world} ranks ({os.environ.get('LOCAL_RANK')})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
