"""What a script's own command line says about its settings, for fixes phrased in its terms.

`nanguard run` sees the script's arguments. A script whose clipping is turned off by its own
flag (`--clip 0`, `--grad_clip=0.0`, `--max-grad-norm 0`) never calls `clip_grad_norm_`, so the
call itself cannot tell nanguard that clipping is off; the flag can, and a fix then says "your
clip is 0" instead of suggesting clipping as if the script had no such setting.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["clip_from_argv"]

# Flag names (dashes and underscores folded away, lower case) that set a gradient-clipping norm.
_CLIP_NAME = re.compile(r"^(?:grad(?:ient)?)?clip(?:grad(?:ient)?)?(?:norm|val(?:ue)?)?$"
                        r"|^maxgrad(?:ient)?norm$")


def clip_from_argv(argv: Sequence[str]) -> float | None:
    """The clipping norm a script's flags set, or None when no such flag is given.

    Recognises `--clip`, `--grad-clip`, `--grad_clip`, `--clip-grad-norm`, `--clip_value`,
    `--gradient-clip-val`, `--max-grad-norm` (any mix of dashes and underscores), written as
    `--flag V` or `--flag=V`. The last one given wins (argparse's rule). A value that is not a
    number is ignored.
    """
    found: float | None = None
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if not _CLIP_NAME.match(name.replace("-", "").replace("_", "").lower()):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            found = float(value)
        except ValueError:
            continue
    return found
