"""One rank of the Lightning DDP test, launched the way torchrun launches it (LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT in the environment): `python ddp_worker.py OUT BAD_INDEX STEPS`.
Each rank trains on its own data (no distributed sampler); only rank 1's holds the NaN row.

Ends with os._exit after fit so that interpreter teardown (many seconds on small machines)
does not count against the suite's time."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(1)

from lightning_rig import Regressor, loader, make_data, trainer  # noqa: E402

from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.integrations.lightning import NanguardCallback  # noqa: E402


def main() -> None:
    out, bad_index, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["LOCAL_RANK"])
    data = make_data(8 * steps, bad_index if rank == 1 else None, seed=rank)
    cb = NanguardCallback(policy="skip", out=out,
                          config=GuardConfig(record=RecordConfig(summary=False)))
    model = Regressor()
    t = trainer([cb], steps, strategy="ddp", devices=2, max_epochs=1,
                use_distributed_sampler=False)
    t.fit(model, loader(data))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    total = float(sum(p.double().sum() for p in model.parameters()))
    print(f"RESULT rank={t.global_rank} finite={finite} checksum={total!r}", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
