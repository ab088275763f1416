"""Small files to try `nanguard audit` and `nanguard scan` on, written to the current folder.

Run: python examples/sample_files.py
Writes:
  ckpt.pt, ckpt.safetensors        a small model's weights (the .safetensors needs `safetensors`)
  old.pt, new.pt                   two checkpoints of it; in new.pt one weight went NaN
  checkpoints/checkpoint-500/      a Hugging Face style folder: two shards, their index, the
                                   optimizer state
  train.parquet                    8 feature columns and a label `y` in 0..9; row 7 holds a NaN
                                   (needs `pyarrow`)
  data/part-0.csv, data/part-1.csv the same rows as CSV shards
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, "ckpt.pt")
    torch.save(state, "old.pt")
    broken = {k: v.clone() for k, v in state.items()}
    broken["0.weight"][3, 1] = float("nan")  # what a bad update leaves behind
    torch.save(broken, "new.pt")

    folder = Path("checkpoints/checkpoint-500")
    folder.mkdir(parents=True, exist_ok=True)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    try:
        from safetensors.torch import save_file
    except ImportError:
        print("safetensors is not installed: no .safetensors files (pip install safetensors)")
    else:
        save_file(state, "ckpt.safetensors")
        shards = {"model-00001-of-00002.safetensors": ["0.weight", "0.bias"],
                  "model-00002-of-00002.safetensors": ["2.weight", "2.bias"]}
        for name, keys in shards.items():
            save_file({k: state[k] for k in keys}, str(folder / name))
        index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))

    features = torch.randn(64, 8)
    features[7, 2] = float("nan")  # a bad row, as real exports sometimes hold
    labels = torch.randint(0, 10, (64,))
    columns = {f"x{i}": features[:, i].tolist() for i in range(8)} | {"y": labels.tolist()}
    Path("data").mkdir(exist_ok=True)
    for part, rows in enumerate((range(0, 32), range(32, 64))):
        lines = [",".join(columns)]
        lines += [",".join(str(columns[c][r]) for c in columns) for r in rows]
        (Path("data") / f"part-{part}.csv").write_text("\n".join(lines) + "\n")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        print("pyarrow is not installed: no train.parquet (pip install pyarrow)")
    else:
        pq.write_table(pa.table(columns), "train.parquet")
    print("wrote ckpt.pt, ckpt.safetensors, old.pt, new.pt, checkpoints/checkpoint-500/, "
          "train.parquet, data/")


if __name__ == "__main__":
    main()
