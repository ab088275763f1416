"""Sequence prediction with an LSTM trained by L-BFGS in float64, in the style of the PyTorch
time_sequence_prediction example (`model.double()`, `optimizer.step(closure)`), on mini-batches
of sensor traces from a DataLoader. Each trace is standardized per sequence before the LSTM
(instance normalization, as many forecasting models do):

    x = (x - mean) / sqrt(var + eps)

The data holds a few dead-sensor traces that read exactly 0.0 throughout.

    python lbfgs_seq.py --max-iters 8
    python lbfgs_seq.py --eps 0          # fails
    python lbfgs_seq.py --gap 3 10       # fails

How it fails: `--eps 0`: a dead trace has zero variance, the standardization divides 0 by
sqrt(0) = 0 and the forward of the batch holding it yields NaN (division by zero); L-BFGS then
writes NaN into every weight. `--gap TRACE T`: reading T of trace TRACE was lost (NaN, as a
logger writes a dropped sample); the batch holding it is NaN from the first closure call.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def make_traces(n: int, length: int, dead: list[int], seed: int) -> torch.Tensor:
    """Noisy sine waves of random phase, amplitude and period; `dead` traces are all zero."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(length, dtype=torch.float64)
    phase = torch.rand(n, 1, generator=g, dtype=torch.float64) * 2 * math.pi
    period = 12 + 12 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    amp = 0.5 + torch.rand(n, 1, generator=g, dtype=torch.float64)
    x = amp * torch.sin(2 * math.pi * t / period + phase) + 3.0
    x = x + 0.02 * torch.randn(n, length, generator=g, dtype=torch.float64)
    x[dead] = 0.0
    return x


class Sequence(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # per-sequence standardization
        mean = input.mean(dim=1, keepdim=True)
        var = input.var(dim=1, keepdim=True, unbiased=False)
        input = (input - mean) / torch.sqrt(var + self.eps)
        outputs = []
        n = input.size(0)
        h_t = torch.zeros(n, self.lstm1.hidden_size, dtype=torch.double)
        c_t = torch.zeros(n, self.lstm1.hidden_size, dtype=torch.double)
        h_t2 = torch.zeros(n, self.lstm2.hidden_size, dtype=torch.double)
        c_t2 = torch.zeros(n, self.lstm2.hidden_size, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs.append(self.linear(h_t2))
        return torch.cat(outputs, dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description="LSTM sequence prediction with L-BFGS (float64)")
    p.add_argument("--data", default=None, help="a .pt tensor [N, T] of traces")
    p.add_argument("--traces", type=int, default=64)
    p.add_argument("--length", type=int, default=40)
    p.add_argument("--dead", type=int, nargs="*", default=[29, 50],
                   help="indices of all-zero (dead sensor) traces in the generated data")
    p.add_argument("--gap", type=int, nargs=2, default=None, metavar=("TRACE", "T"),
                   help="reading T of trace TRACE is missing (NaN)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.8)
    p.add_argument("--max-iter", type=int, default=4, help="L-BFGS iterations per step")
    p.add_argument("--eps", type=float, default=1e-5, help="standardization epsilon")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-iters", type=int, default=12, help="stop after this many steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    if args.data:
        data = torch.load(args.data).double()
    else:
        data = make_traces(args.traces, args.length, args.dead, args.seed)
    if args.gap:
        data[args.gap[0], args.gap[1]] = float("nan")
    # next-value prediction: input x[:, :-1], target x[:, 1:] (standardized the same way)
    dataset = TensorDataset(data[:, :-1], data[:, 1:])
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False)

    seq = Sequence(args.hidden, args.eps)
    seq.double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=args.lr, max_iter=args.max_iter)

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([seq], [optimizer])

    def make_closure(x: torch.Tensor, target: torch.Tensor):
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            out = seq(x)
            loss = criterion(out, target)
            if tracer:
                tracer.loss(loss)
            loss.backward()
            if tracer:
                tracer.grads()
            return loss
        return closure

    step = 0
    for epoch in range(args.epochs):
        for x, y in loader:
            if step >= args.max_iters:
                break
            mean = x.mean(dim=1, keepdim=True)
            std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + 1e-8)
            target = (y - mean) / std
            if tracer:
                tracer.start(x)
            loss = optimizer.step(make_closure(x, target))
            if tracer:
                tracer.updated()
            print(f"epoch {epoch} step {step}: loss {loss.item():.6f}")
            step += 1
    with torch.no_grad():
        test = data[:4, :-1]
        pred = seq(test)
        print(f"predictions: mean {pred.mean().item():.4f}")


if __name__ == "__main__":
    main()
