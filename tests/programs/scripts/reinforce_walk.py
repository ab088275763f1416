"""REINFORCE, the textbook policy gradient: a policy network picks left or right on a 1-D
walk (an episode ends at +-5 or after 60 moves; reward +1 per move that gets nearer to +5,
-1 otherwise), discounted returns summed backwards in Python floats, made a tensor and
normalised, one Adam step per episode.

    python reinforce_walk.py --episodes 40 [--gamma 0.99] [--lr 0.01]

How it fails: `--gamma 99` (a typo of 0.99) makes each step back multiply the return by 99;
an episode of 20 moves or more sums past float32's largest value and `torch.tensor(returns)`
holds inf (then inf - inf is NaN in the normalisation). The script prints
`NOTE returns beyond float32 at update K` (K = updates before it) from its own float64
returns, before it makes the tensor.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributions import Categorical

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args()
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    noted = False

    for episode in range(args.episodes):
        pos, log_probs, rewards = 0, [], []
        for t in range(60):
            state = torch.tensor([pos / 5.0, t / 60.0])
            dist = Categorical(logits=policy(state))
            action = dist.sample()
            log_probs.append(dist.log_prob(action))
            step = 1 if int(action) == 1 else -1
            pos += step
            rewards.append(1.0 if step > 0 else -1.0)
            if abs(pos) >= 5:
                break
        ret, returns = 0.0, []
        for r in reversed(rewards):
            ret = r + args.gamma * ret
            returns.insert(0, ret)
        if not noted and max(abs(x) for x in returns) > FLOAT32_MAX:
            print(f"NOTE returns beyond float32 at update {episode}", flush=True)
            noted = True
        returns_t = torch.tensor(returns)
        returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + 1e-8)
        loss = -(torch.stack(log_probs) * returns_t).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if episode % 10 == 0:
            print(f"episode {episode} length {len(rewards)} end {pos}", flush=True)


if __name__ == "__main__":
    main()
