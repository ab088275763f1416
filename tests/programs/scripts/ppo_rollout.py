"""A small PPO: an actor-critic on a synthetic 'reach the target' task, a rollout buffer,
generalised advantages, minibatch epochs with advantage normalisation.

    python ppo_rollout.py --iters 6 --rollout 32 --minibatch 8 [--gamma 0.99] [--returns python]

Each iteration collects `--rollout` transitions (a point moved by a Gaussian policy toward a
random target; reward = -distance), computes returns, then runs `--epochs` passes of shuffled
minibatches of `--minibatch` transitions: the clipped policy loss plus the value loss, one Adam
step per minibatch.

How it fails (each way through a flag, the script unmodified):

* `--rollout 33 --minibatch 8`: the last minibatch of each epoch holds a single transition and
  `adv.std()` of one element is 0 / 0 (`correction=1`: n - 1 = 0). The script prints
  `NOTE minibatch of 1 at update K` (K = Adam steps before it) the first time.
* `--returns python --gamma 9.9` (a typo of 0.99): discounted returns summed in Python floats
  grow past float32's largest value; `torch.tensor(returns)` holds inf. The script prints
  `NOTE returns overflow float32 at update K` (the largest return, checked in float64).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class ActorCritic(nn.Module):
    def __init__(self, obs: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh())
        self.mu = nn.Linear(hidden, 2)
        self.log_std = nn.Parameter(torch.full((2,), -0.5))
        self.value = nn.Linear(hidden, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Normal, torch.Tensor]:
        h = self.body(obs)
        return torch.distributions.Normal(self.mu(h), self.log_std.exp()), self.value(h)[:, 0]


def rollout(net: ActorCritic, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    pos = torch.zeros(2)
    target = torch.randn(2, generator=gen)
    obs, acts, logps, rews, vals = [], [], [], [], []
    with torch.no_grad():
        for _ in range(n):
            o = torch.cat([pos, target])
            dist, v = net(o[None])
            a = dist.sample()[0]
            obs.append(o)
            acts.append(a)
            logps.append(dist.log_prob(a[None]).sum(-1)[0])
            vals.append(v[0])
            pos = pos + 0.1 * a.clamp(-1, 1)
            rews.append(-float((pos - target).norm()))
    return {"obs": torch.stack(obs), "act": torch.stack(acts), "logp": torch.stack(logps),
            "val": torch.stack(vals), "rew": torch.tensor(rews)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--rollout", type=int, default=32)
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--returns", choices=("tensor", "python"), default="tensor",
                   help="sum the discounted returns in tensors or in Python floats")
    args = p.parse_args()

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    net = ActorCritic()
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    updates, noted = 0, set()
    for it in range(args.iters):
        buf = rollout(net, args.rollout, gen)
        if args.returns == "python":
            g, rets = 0.0, []
            for r in reversed(buf["rew"].tolist()):
                g = r + args.gamma * g
                rets.append(g)
            rets.reverse()
            if "overflow" not in noted and max(abs(x) for x in rets) > torch.finfo().max:
                noted.add("overflow")
                print(f"NOTE returns overflow float32 at update {updates}", flush=True)
            returns = torch.tensor(rets)
        else:
            returns = torch.zeros(args.rollout)
            g_t = torch.zeros(())
            for t in reversed(range(args.rollout)):
                g_t = buf["rew"][t] + args.gamma * g_t
                returns[t] = g_t
        adv_all = returns - buf["val"]
        for _ in range(args.epochs):
            order = torch.randperm(args.rollout)
            for i in range(0, args.rollout, args.minibatch):
                idx = order[i:i + args.minibatch]
                if len(idx) == 1 and "one" not in noted:
                    noted.add("one")
                    print(f"NOTE minibatch of 1 at update {updates}", flush=True)
                adv = adv_all[idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                dist, v = net(buf["obs"][idx])
                ratio = (dist.log_prob(buf["act"][idx]).sum(-1) - buf["logp"][idx]).exp()
                pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                loss = pg + 0.5 * ((v - returns[idx]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                updates += 1
        print(f"iter {it} mean reward {buf['rew'].mean():.3f} loss {loss.item():.4f}")
    print("done")


if __name__ == "__main__":
    main()
