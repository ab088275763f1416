"""Diagnosis rules: one small unit per cause of the vocabulary (shared/DESIGN.md section 3).

A rule reads an `Evidence` and returns a `Cause` or None. Its docstring says what evidence it
needs and what rules it out; where a piece of evidence is missing (no op-level replay, no
activation watching) it fires with a lower confidence and its evidence text says what is
missing, rather than claiming what it cannot see. Adding a cause means adding one function to
the module of its family and to `RULES` below (with a positive and a negative test in
tests/explain/).

Fixes use the run's own numbers (LR, healthy grad norm, the growth it measured) and the user's
entry point (`Evidence.entry`: a `Guard(...)` option for `api` users, a `nanguard run` flag for
zero-code users).

The families: where the value came from (`origin`), an op at a bad point (`ops`,
`division`, and the rest of the op table in `semantics`), the optimizer (`optimizer`), the LR
schedule (`schedule`), magnitudes and alarms over the run (`dynamics`), faults outside the
model's math (`faults`); what several of them read is in `common`.
"""

from __future__ import annotations

from nanguard.explain.rules.common import Rule
from nanguard.explain.rules.division import division_by_zero
from nanguard.explain.rules.dynamics import bad_batch, exploding_init, vanishing_gradients
from nanguard.explain.rules.faults import checkpoint_corrupt, nondeterministic, replica_divergence
from nanguard.explain.rules.ops import (
    exp_overflow,
    log_of_nonpositive,
    low_precision_overflow,
    masked_softmax,
    saturated_loss,
    singular_gradient,
)
from nanguard.explain.rules.optimizer import optimizer_divergence, optimizer_state_nonfinite
from nanguard.explain.rules.origin import (
    checkpoint_nonfinite,
    data_nonfinite,
    init_nonfinite,
    label_nonfinite,
)
from nanguard.explain.rules.schedule import lr_jump
from nanguard.explain.rules.semantics import (
    arithmetic_overflow,
    cast_overflow,
    domain_error,
    inf_arithmetic,
)

RULES: list[Rule] = [
    checkpoint_nonfinite,
    init_nonfinite,
    data_nonfinite,
    label_nonfinite,
    log_of_nonpositive,
    saturated_loss,
    division_by_zero,
    domain_error,
    cast_overflow,
    inf_arithmetic,
    singular_gradient,
    masked_softmax,
    exp_overflow,
    low_precision_overflow,
    optimizer_state_nonfinite,
    optimizer_divergence,
    lr_jump,
    exploding_init,
    bad_batch,
    vanishing_gradients,
    arithmetic_overflow,
    replica_divergence,
    nondeterministic,
    checkpoint_corrupt,
]
"""Every rule, in the order `diagnose` runs them (causes of equal confidence keep it)."""
