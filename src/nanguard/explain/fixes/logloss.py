"""The fix for a log in a hand-written loss that met a probability rounded to exactly 0, read
from the user's line (the finding's `source`): which loss the line writes decides the one fix
that applies, instead of a list of three for the user to choose from.

* a probability picked at the targets, `-torch.log(y_hat[range(len(y_hat)), y])` or
  `-probs[torch.arange(n), ys].log().mean()` (a softmax computed first, then its log: the
  classification loss of d2l's and makemore's from-scratch code): `F.cross_entropy` on the
  logits, which takes `log_softmax` and never rounds a probability to 0;
* a complement, `log(1 - h)` (a hand-written binary cross-entropy of `h = sigmoid(z)`):
  `F.binary_cross_entropy_with_logits` on the logits.

Any other line (or no readable source) keeps the rule's general fix.
"""

from __future__ import annotations

import re

from nanguard.explain.evidence import Evidence
from nanguard.explain.fixes.scale import source_line

# `name[rows, targets]` with two index expressions: one entry per row, at the row's target.
_PICK = re.compile(r"(\w+)\s*\[[^\[\]]+,\s*(\w+)\s*\]")
# `log(1 - h)`, `torch.log(1. - h)`, `(1 - h).log()`
_COMPLEMENT = re.compile(r"log\(\s*1\.?0*\s*-|\(\s*1\.?0*\s*-\s*[\w.]+\s*\)\s*\.log\(")


def saturated_log(ev: Evidence) -> tuple[str, str] | None:
    """(what the line shows, the fix) for the log of a saturated probability at the finding's
    line, when the line says which loss it writes; else None."""
    text = source_line(ev)
    if "log" not in text:
        return None
    if _COMPLEMENT.search(text):
        return (f"; the line is a binary cross-entropy written by hand (`{text}`)",
                "compute it from the logits `z` the sigmoid was applied to: "
                "`F.binary_cross_entropy_with_logits(z, y)` (or `F.logsigmoid(z)` for "
                "`log(h)` and `F.logsigmoid(-z)` for `log(1 - h)`); it never rounds to 0")
    pick = _PICK.search(text)
    if pick is None:
        return None
    probs, target = pick.group(1), pick.group(2)
    return (f"; the line takes the log of `{probs}` picked at the targets `{target}`, a softmax "
            f"computed before its log (`{text}`)",
            f"compute the loss from the logits that made `{probs}`: "
            f"`F.cross_entropy(logits, {target})` (log_softmax inside: a probability that "
            f"rounds to 0 is still a finite log there); or `F.log_softmax(logits, dim=1)` "
            f"picked at `{target}` in place of the log of `{probs}`")
