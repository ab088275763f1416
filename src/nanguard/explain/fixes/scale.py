"""An exp that makes a scale from a model output (`std = torch.exp(0.5 * log_var)` in a VAE,
`log_std.exp()` in a Gaussian policy): its fix bounds the log-scale, never "subtract the
max", which is a softmax's fix and does not apply to a variance.

Read from the user's line (the finding's `source`, `path:line` as the checker recorded it):
a name of a log-scale (`log_var`, `logvar`, `log_std`, `log_sigma`, `log_scale`) or the
reparameterisation's `exp(0.5 * x)`.
"""

from __future__ import annotations

import linecache
import re

from nanguard.explain.evidence import Evidence

_NAME = re.compile(r"\b(\w*log_?(?:var(?:iance)?|std|sigma|scale|sd)\w*)\b", re.IGNORECASE)
_HALF = re.compile(r"exp\(\s*(?:0?\.5\s*\*\s*(\w+)|(\w+)\s*(?:\*\s*0?\.5|/\s*2))\s*\)")


def source_line(ev: Evidence) -> str:
    """The text of the line the finding names (`source` = `path:line`), or "" when it cannot
    be read (no source, a file that moved, a path relative to another folder)."""
    src = str((ev.first_nonfinite or {}).get("source") or "")
    path, _, line = src.rpartition(":")
    if not path or not line.isdigit():
        return ""
    return linecache.getline(path, int(line)).strip()


def log_scale(ev: Evidence) -> tuple[str, str] | None:
    """(what the evidence says, the fix) when the exp at the finding's line makes a scale from
    a log-scale; else None."""
    if not ev.op.startswith(("aten.exp", "aten.expm1")):
        return None
    text = source_line(ev)
    m = _NAME.search(text)
    half = _HALF.search(text)
    if m is None and half is None:
        return None
    var = m.group(1) if m else (half.group(1) or half.group(2)) if half else "log_var"
    what = f"; the line exps `{var}`, a log-scale (`{text}`)"
    fix = (f"bound the log-scale before the exp: `{var} = {var}.clamp(-30, 20)` (exp(20) and "
           f"exp(0.5 * 20) are far inside float32), or make the scale with softplus: "
           f"`std = F.softplus(raw) + 1e-4` instead of an exp; a softmax's \"subtract the max\" "
           f"does not apply to a variance")
    return what, fix
