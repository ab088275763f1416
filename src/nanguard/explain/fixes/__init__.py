"""What a fix proposes, made plausible for the run it is for: an LR in the range the optimizer
trains with (a typed-in LR 1e5x its default read as a typo), the script's own flag when a value
came from one, and a bound on a log-variance rather than a softmax's shift (shared/DESIGN.md
section 10, "Fixes a user would type"). The rules in `explain.rules` word their fixes with it.
"""

from nanguard.explain.fixes.flags import (
    Flag,
    below_one,
    context_words,
    find_flag,
    holders,
    number,
)
from nanguard.explain.fixes.logloss import saturated_log
from nanguard.explain.fixes.lr import LrRange, lr_range, lr_typo, plausible_lr
from nanguard.explain.fixes.scale import library, log_scale
from nanguard.explain.fixes.singular import sqrt_at_zero

__all__ = ["Flag", "LrRange", "below_one", "context_words", "find_flag", "holders", "library",
           "log_scale", "lr_range", "lr_typo", "number", "plausible_lr", "saturated_log",
           "sqrt_at_zero"]
