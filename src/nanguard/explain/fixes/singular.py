"""The fix for the infinite derivative of a square root at 0, written for the user's line
(the finding's `source`: for a backward op, the forward line that made the node): the one
`sqrt` there gets its epsilon in place (`distances.sqrt()` -> `(distances + 1e-12).sqrt()`,
`torch.sqrt(d)` -> `torch.sqrt(d + 1e-12)`), instead of a generic `torch.sqrt(x + 1e-12)`.
A line with no sqrt, or more than one, keeps the rule's general fix.
"""

from __future__ import annotations

import re

from nanguard.explain.evidence import Evidence
from nanguard.explain.fixes.scale import library, source_line

_METHOD = re.compile(r"\b([A-Za-z_][\w.]*)\.sqrt\(\)")  # `distances.sqrt()`
_CALL = re.compile(r"\btorch\.sqrt\(\s*([\w.]+)\s*\)")  # `torch.sqrt(d)`


def sqrt_at_zero(ev: Evidence) -> str | None:
    """The edit of the finding's line that keeps its sqrt away from 0, or None."""
    if library(ev) is not None:
        return None  # library code: not the user's line to edit
    text = source_line(ev)
    if text.count("sqrt") != 1:
        return None
    m = _METHOD.search(text)
    if m is not None:
        x = m.group(1)
        return (f"`{x}.sqrt()` -> `({x} + 1e-12).sqrt()` at this line (sqrt's gradient at "
                f"exactly 0 is infinite: a distance between two identical points is 0)")
    m = _CALL.search(text)
    if m is not None:
        x = m.group(1)
        return (f"`torch.sqrt({x})` -> `torch.sqrt({x} + 1e-12)` at this line (sqrt's "
                f"gradient at exactly 0 is infinite: a distance between two identical points "
                f"is 0)")
    return None
