"""An exp that makes a scale from a model output (`std = torch.exp(0.5 * log_var)` in a VAE,
`log_std.exp()` in a Gaussian policy): its fix bounds the log-scale, never "subtract the
max", which is a softmax's fix and does not apply to a variance.

Read from the user's line (the finding's `source`, `path:line` as the checker recorded it):
a name of a log-scale (`log_var`, `logvar`, `log_std`, `log_sigma`, `log_scale`), the
reparameterisation's `exp(0.5 * x)`, or a Gaussian KL term's `1 + lv - mu.pow(2) - lv.exp()`.
"""

from __future__ import annotations

import linecache
import re

from nanguard.explain.evidence import Evidence

_NAME = re.compile(r"\b(\w*log_?(?:var(?:iance)?|std|sigma|scale|sd)\w*)\b", re.IGNORECASE)
_INNER = r"\(\s*(?:0?\.5\s*\*\s*(\w+)|(\w+)\s*(?:\*\s*0?\.5|/\s*2))\s*\)"
_HALF = re.compile(rf"exp{_INNER}|{_INNER}\.exp\(\)")  # exp(0.5 * x), (x / 2).exp()
# A Gaussian's KL term, `-0.5 * (1 + lv - mu.pow(2) - lv.exp())`: the exp'd name is its
# log-variance whatever it is called.
_KL = re.compile(r"1\s*\+\s*(\w+)\s*-.*(?:\.pow\(\s*2\s*\)|\*\*\s*2).*\b\1\.exp\(\)"
                 r"|1\s*\+\s*(\w+)\s*-.*(?:\.pow\(\s*2\s*\)|\*\*\s*2).*exp\(\s*\2\s*\)")


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
    kl = _KL.search(text)
    if m is not None:
        var = m.group(1)
    elif half is not None:
        var = next(g for g in half.groups() if g)
    elif kl is not None:
        var = kl.group(1) or kl.group(2)
    else:
        return None
    package = library(ev)
    if package is not None:
        # Library code: the fix goes where the user's code hands it the log-scale.
        what = f"; the exp runs inside {package} on a log-scale (`{text}`)"
        return what, (f"bound the log-scale your code passes to {package} (or the output that "
                      "feeds it): `.clamp(-30, 20)` before the call, or a softplus scale "
                      "instead of an exp; a softmax's \"subtract the max\" does not apply")
    what = f"; the line exps `{var}`, a log-scale (`{text}`)"
    fix = (f"bound the log-scale before the exp: `{var} = {var}.clamp(-30, 20)` (exp(20) and "
           f"exp(0.5 * 20) are far inside float32), or make the scale with softplus: "
           f"`std = F.softplus(raw) + 1e-4` instead of an exp; a softmax's \"subtract the max\" "
           f"does not apply to a variance")
    return what, fix


def library(ev: Evidence) -> str | None:
    """The installed package the finding's line is in (`transformers` for
    `.../site-packages/transformers/models/...`), or None for the user's own code: a fix is
    then worded for the user's call into it, never as an edit of the library."""
    src = str((ev.first_nonfinite or {}).get("source") or "").replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in src:
            return src.split(marker, 1)[1].split("/", 1)[0].removesuffix(".py") or None
    return None
