"""A tiny deterministic actor-critic with two optimizers and an LR flag for each, as
off-policy RL scripts have them (CleanRL's SAC: `--q-lr`, `--policy-lr`).

    python actor_critic.py [--critic-lr 3e-4] [--actor-lr 3e-4] [--steps 60]

The critic regresses Q(s, a) onto a bootstrapped target r + 0.99 Q(s', pi(s')); the actor
maximises Q(s, pi(s)) through a tanh. `--lr1` / `--lr2` are other names for the two flags
(names that say nothing of the part). After each update the script checks its own parts and
prints the first one whose parameters or optimizer state went non-finite.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def finite(model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in [*model.parameters(), *state])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--critic-lr", "--lr1", type=float, default=1e-3)
    p.add_argument("--actor-lr", "--lr2", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    critic = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 1))
    actor = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1), nn.Tanh())
    critic_opt = torch.optim.SGD(critic.parameters(), lr=a.critic_lr, momentum=0.9)
    actor_opt = torch.optim.SGD(actor.parameters(), lr=a.actor_lr, momentum=0.9)
    first = None
    for step in range(a.steps):
        s, s2, r = torch.randn(64, 4, generator=g), torch.randn(64, 4, generator=g), \
            torch.randn(64, 1, generator=g)
        with torch.no_grad():
            target = r + 0.99 * critic(torch.cat([s2, actor(s2)], 1))
        q = critic(torch.cat([s, actor(s).detach()], 1))
        critic_loss = F.mse_loss(q, target)
        critic_opt.zero_grad()
        critic_loss.backward()
        critic_opt.step()
        if first is None and not finite(critic, critic_opt):
            first = f"critic at update {step}"
        actor_loss = -critic(torch.cat([s, actor(s)], 1)).mean()
        actor_opt.zero_grad()
        actor_loss.backward()
        actor_opt.step()
        if first is None and not finite(actor, actor_opt):
            first = f"actor at update {step}"
        print(f"step {step} critic_loss {critic_loss.item():.4g} "
              f"actor_loss {actor_loss.item():.4g}")
    print(f"first non-finite: {first}")


if __name__ == "__main__":
    main()
