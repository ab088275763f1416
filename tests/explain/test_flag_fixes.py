"""Fixes that name the script's own flag when the flag made the fault (issue 37, "fixes a
user would type", found on held-out programs): a batch-size flag that makes every batch one
row (`std` over n <= correction), a discount factor above 1 that sums returns past float32,
and a hand-written update's LR. Each finding comes from a real op under the op checker; the
near miss (the flag holds another value) must not name the flag."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from nanguard.explain import Evidence, diagnose
from nanguard.explain.fixes import below_one, find_flag
from nanguard.pinpoint.replay import run_checked


def _top(fn: Callable[[], object], argv: list[str]) -> tuple[str, str]:
    """(cause, fix) of the top diagnosis for `fn()` run under the op checker, with `argv`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # std's "degrees of freedom <= 0" is expected here
        origin, _ = run_checked(fn, model=None, step=0)
    assert origin is not None
    top = diagnose(Evidence(first_nonfinite=origin.to_dict(), argv=argv))[0]
    return top.cause, top.fix


def _one_row_std() -> torch.Tensor:
    w = torch.randn(3, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    h = torch.ones(1, 3) @ w
    return (h - h.mean(0)) / h.std(0)


def test_a_batch_size_flag_of_one_is_named_first() -> None:
    cause, fix = _top(_one_row_std, ["--steps", "3", "--batch-size", "1"])
    assert cause == "division_by_zero"
    assert fix.startswith("`--batch-size 1` makes batches of 1 row: set `--batch-size 2`")


def test_a_batch_flag_that_left_a_last_batch_of_one_is_not_blamed() -> None:
    """`--batch 19` over 96 rows: the flag is not 1, the last batch is; the generic fix."""
    cause, fix = _top(_one_row_std, ["--batch", "19"])
    assert cause == "division_by_zero" and "--batch" not in fix
    assert fix.startswith("at that line, never take `std` of fewer than 2 values")


def _returns(gamma: float) -> torch.Tensor:
    ret, rets = 0.0, []
    for r in [1.0] * 30:
        ret = r + gamma * ret
        rets.append(ret)
    return torch.tensor(rets)


def test_a_discount_factor_above_one_is_read_as_its_typo() -> None:
    cause, fix = _top(lambda: _returns(99.0), ["--gamma", "99"])
    assert cause == "cast_overflow"
    assert "`--gamma 99` is a discount factor above 1" in fix
    assert fix.endswith("did you mean `--gamma 0.99`?")
    cause, fix = _top(lambda: _returns(99.0), ["--episodes", "10"])  # no such flag
    assert cause == "cast_overflow" and "--gamma" not in fix


def test_below_one_reads_the_digits_as_typed() -> None:
    meant = {t: below_one(find_flag(["--gamma", t], "gamma"))  # type: ignore[arg-type]
             for t in ("99", "9.9", "995", "0.99", "1.5", "2000")}
    assert meant == {"99": "0.99", "9.9": "0.99", "995": "0.995", "0.99": None,
                     "1.5": None, "2000": None}
    assert find_flag(["--discount-factor", "99"], "gamma") is not None
    assert find_flag(["--bs", "1"], "batch_size") is not None
    assert find_flag(["--batch-size-eval", "1"], "batch_size") is None
