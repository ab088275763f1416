"""The script's own clipping flag, read from its command line (run/script_flags.py)."""

from __future__ import annotations

import pytest

from nanguard.run.script_flags import clip_from_argv


@pytest.mark.parametrize("argv, want", [
    (["--clip", "0"], 0.0),
    (["--grad_clip=0.0"], 0.0),
    (["--max-grad-norm", "0"], 0.0),
    (["--gradient-clip-val", "1.5"], 1.5),
    (["--lr", "1", "--clip-grad-norm=0"], 0.0),
    (["--clip", "1", "--clip", "0"], 0.0),  # argparse: the last one wins
])
def test_clip_flags_are_read(argv: list[str], want: float) -> None:
    assert clip_from_argv(argv) == want


@pytest.mark.parametrize("argv", [
    ["--clip"], ["--clip", "x"], ["--clipboard", "0"], ["--eclip", "0"], ["--lr", "0"], [],
])
def test_other_flags_are_not_a_clip(argv: list[str]) -> None:
    assert clip_from_argv(argv) is None
