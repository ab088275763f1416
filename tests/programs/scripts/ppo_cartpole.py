"""PPO on a cart-pole written in torch (the classic equations, 8 environments side by side),
in the style of single-file PPO implementations: an actor-critic MLP, rollouts of the current
policy, GAE, clipped surrogate + value loss - entropy bonus, a few epochs of minibatches over
each rollout, one Adam optimizer, gradient clipping.

    python ppo_cartpole.py --iterations 12

Healthy: every iteration brings a new rollout and, as the pole stays up longer, returns and
with them the value loss grow; the loss is not a stationary series. The script prints each
iteration's mean loss (`ITER i loss L return R`) so a test can see that for itself.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
from torch.distributions import Categorical


class CartPoles:
    """N cart-poles stepped together (Barto, Sutton & Anderson's dynamics, as in Gym)."""

    def __init__(self, n: int, g: torch.Generator) -> None:
        self.n, self.g = n, g
        self.state = self._reset(n)
        self.t = torch.zeros(n)

    def _reset(self, n: int) -> torch.Tensor:
        return (torch.rand(n, 4, generator=self.g) - 0.5) * 0.1

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, x_dot, th, th_dot = self.state.unbind(1)
        force = (action.float() * 2 - 1) * 10.0
        cos, sin = th.cos(), th.sin()
        temp = (force + 0.05 * th_dot ** 2 * sin) / 1.1
        th_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * th_acc * cos / 1.1
        self.state = torch.stack([x + 0.02 * x_dot, x_dot + 0.02 * x_acc,
                                  th + 0.02 * th_dot, th_dot + 0.02 * th_acc], dim=1)
        self.t += 1
        done = ((self.state[:, 0].abs() > 2.4) | (self.state[:, 2].abs() > 12 * math.pi / 180)
                | (self.t >= 200))
        reward = torch.ones(self.n)
        if done.any():
            self.state[done] = self._reset(int(done.sum()))
            self.t[done] = 0
        return self.state.clone(), reward, done.float()


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                    nn.Linear(64, 1))
        self.actor = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                   nn.Linear(64, 2))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--num-steps", type=int, default=64)
    ap.add_argument("--update-epochs", type=int, default=4)
    ap.add_argument("--num-minibatches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2.5e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    envs = CartPoles(args.num_envs, g)
    agent = Agent()
    opt = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    gamma, lam, clip, batch = 0.99, 0.95, 0.2, args.num_envs * args.num_steps
    obs = envs.state.clone()
    ep_len = torch.zeros(args.num_envs)
    finished: list[float] = []
    for it in range(args.iterations):
        buf_obs, buf_act, buf_logp, buf_rew, buf_done, buf_val = [], [], [], [], [], []
        with torch.no_grad():
            for _ in range(args.num_steps):
                logits, value = agent(obs)
                dist = Categorical(logits=logits)
                action = dist.sample()
                buf_obs.append(obs)
                buf_act.append(action)
                buf_logp.append(dist.log_prob(action))
                buf_val.append(value)
                obs, reward, done = envs.step(action)
                ep_len += 1
                finished += ep_len[done.bool()].tolist()
                ep_len[done.bool()] = 0
                buf_rew.append(reward)
                buf_done.append(done)
            _, next_value = agent(obs)
            adv = torch.zeros(args.num_steps, args.num_envs)
            last = torch.zeros(args.num_envs)
            for t in reversed(range(args.num_steps)):
                nv = next_value if t == args.num_steps - 1 else buf_val[t + 1]
                nonterm = 1.0 - buf_done[t]
                delta = buf_rew[t] + gamma * nv * nonterm - buf_val[t]
                last = delta + gamma * lam * nonterm * last
                adv[t] = last
            returns = adv + torch.stack(buf_val)
        b_obs = torch.stack(buf_obs).reshape(batch, 4)
        b_act, b_logp = torch.stack(buf_act).reshape(-1), torch.stack(buf_logp).reshape(-1)
        b_adv, b_ret = adv.reshape(-1), returns.reshape(-1)
        mb = batch // args.num_minibatches
        losses = []
        for _ in range(args.update_epochs):
            perm = torch.randperm(batch, generator=g)
            for start in range(0, batch, mb):
                idx = perm[start:start + mb]
                logits, value = agent(b_obs[idx])
                dist = Categorical(logits=logits)
                ratio = (dist.log_prob(b_act[idx]) - b_logp[idx]).exp()
                a = b_adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                pg = torch.max(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)).mean()
                v_loss = 0.5 * ((value - b_ret[idx]) ** 2).mean()
                loss = pg + 0.5 * v_loss - 0.01 * dist.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                opt.step()
                losses.append(loss.item())
        recent = finished[-20:] or [0.0]
        print(f"ITER {it} loss {sum(losses) / len(losses):.4f} "
              f"return {sum(recent) / len(recent):.1f}")


if __name__ == "__main__":
    main()
