"""Optimizers built one after the other over the same parameters: one training, several parts.

Some scripts build a new optimizer every epoch (`opt = Adam(model.parameters(), lr=lr * 0.8 **
epoch)`) or at each stage of a schedule. `nanguard run` gives every optimizer its own guard
(its hooks, detectors and record live with it), so such a script ends with one part per
optimizer: twelve tables of eight steps and a headline that counts one part's steps.
`chains` finds these runs of parts so that the record says so plainly, counts their steps
together and shows the last part's table only. (Each new part's detectors start from the
baselines of the part it replaces, `Guard.take_baselines`: without them the spike detector
would judge every epoch from a fresh warm-up.)
"""

from __future__ import annotations

from typing import Any

from nanguard.run.watched import Watched

__all__ = ["chain_note", "chains", "replaced"]


def _ids(optimizer: Any) -> frozenset[int]:
    """The parameters an optimizer holds, by identity."""
    groups: Any = getattr(optimizer, "param_groups", None) or []
    return frozenset(id(p) for g in groups for p in g.get("params", []))


def _params(w: Watched) -> frozenset[int]:
    return _ids(w.optimizer)


def replaced(watched: list[Watched], optimizer: Any) -> Watched | None:
    """The latest part whose optimizer holds exactly `optimizer`'s parameters (the one it
    replaces, in a chain), or None."""
    mine = _ids(optimizer)
    return next((w for w in reversed(watched) if mine and _params(w) == mine), None)


def chains(watched: list[Watched]) -> list[list[Watched]]:
    """Runs of at least two parts, in the order they trained, where each part's optimizer
    holds exactly the parameters of the one before it and took its first step after that
    one's last (never two at a time: a GAN's two optimizers are two models, not a chain)."""
    parts = sorted((w for w in watched if w.starts), key=lambda w: w.starts[0])
    out: list[list[Watched]] = []
    run: list[Watched] = []
    for w in parts:
        prev = run[-1] if run else None
        if (prev is not None and _params(w) == _params(prev) and _params(w)
                and w.starts[0] > prev.starts[-1]):
            run.append(w)
            continue
        if len(run) > 1:
            out.append(run)
        run = [w]
    if len(run) > 1:
        out.append(run)
    return out


def chain_note(chain: list[Watched]) -> str:
    """The one line the summary prints for a chain (and `run.notes` keeps)."""
    steps = [len(w.starts) for w in chain]
    return (f"{chain[0].name} .. {chain[-1].name}: {len(chain)} optimizers over the same "
            f"parameters, one after the other ({sum(steps)} steps in all, "
            f"~{round(sum(steps) / len(chain))} each): one training, recorded in parts; each "
            "part's detectors started from the baselines of the one before (episodes and "
            "cooldowns afresh). To keep one record, build the optimizer once and change its "
            "LR in place (`for g in opt.param_groups: g['lr'] = lr`) or use an LR scheduler")
