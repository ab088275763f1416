"""A fix names the LR flag of the part that diverged when two flags hold the same LR
(CleanRL's SAC at `--q-lr 3 --policy-lr 3` got "lr=3 -> 0.001", no flag): the one whose name
names the failing part (`q_optimizer.step()` is the critic's), else all of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from in_process import nanguard
from nanguard.explain.fixes import find_flag, holders
from nanguard.explain.fixes.flags import words

SCRIPT = str(Path(__file__).parent / "scripts" / "actor_critic.py")


def _run(tmp: Path, *args: str) -> tuple[str, str]:
    """(the part the script itself saw go non-finite first, the top cause's fix)."""
    r = nanguard(["run", "--out", str(tmp / "r"), SCRIPT, "--steps", "16", *args], tmp)
    first = re.search(r"^first non-finite: (\w+)", r.stdout, re.M)
    assert first is not None, r.stdout[-2000:]
    report = json.loads((tmp / "r" / "report.json").read_text())
    assert report["status"] == "failed", report["status"]
    return first.group(1), report["diagnosis"][0]["fix"]


def test_the_critics_flag_is_named_when_the_critic_diverged(tmp_path: Path) -> None:
    part, fix = _run(tmp_path, "--critic-lr", "1", "--actor-lr", "1")
    assert part == "critic"  # the script's own check after each update
    assert "`--critic-lr 1` -> `--critic-lr " in fix and "--actor-lr" not in fix, fix


def test_flags_whose_names_say_nothing_are_all_named(tmp_path: Path) -> None:
    part, fix = _run(tmp_path, "--lr1", "1.0", "--lr2", "1.0")
    assert part == "critic"
    assert "`--lr1 1.0` and `--lr2 1.0` -> " in fix and "lr=1" not in fix, fix


def test_which_flag_a_line_names() -> None:
    sac = ["--env-id", "Pendulum-v1", "--q-lr", "3", "--policy-lr", "3", "--seed", "1"]
    assert [f.name for f in holders(sac, "lr", [3.0])] == ["--q-lr", "--policy-lr"]
    assert find_flag(sac, "lr", [3.0]) is None  # nothing says which
    q = find_flag(sac, "lr", [3.0], words("q_optimizer.step()"))
    pi = find_flag(sac, "lr", [3.0], words("actor_optimizer.step()"))
    assert (q and q.name, pi and pi.name) == ("--q-lr", "--policy-lr")
    assert find_flag(sac, "lr", [3.0], words("a_optimizer.step()")) is None  # alpha's: either
    gan = ["--lr-d", "2e-4", "--g-lr", "2e-4"]
    d = find_flag(gan, "lr", [2e-4], words("optimizerD.step()"))
    assert d is not None and d.name == "--lr-d"
    # One flag for the setting, another part's value held elsewhere: as before.
    one = find_flag(["--lr", "0.1", "--max-lr", "1"], "lr", [1.0])
    assert one is not None and one.name == "--max-lr"
    assert find_flag(["--q-lr", "3", "--policy-lr", "0.001"], "lr", [3.0]).name == "--q-lr"


def test_a_schedules_bounds_are_no_parts() -> None:
    # `--min-lr`, `--lr-decay`: a schedule's, not a second part's LR; with no value to go
    # by, the LR's own flag (the last one given) as before.
    for argv in (["--lr", "0.1", "--min-lr", "1e-5"], ["--lr", "0.1", "--lr-decay", "0.5"],
                 ["--lr", "0.05", "--max-lr", "1", "--lr", "0.1"]):
        found = find_flag(argv, "lr")
        assert found is not None and (found.name, found.text) == ("--lr", "0.1"), argv
    # A part's flag beside the LR's own: the one holding the failing LR.
    q = find_flag(["--lr", "0.1", "--q-lr", "3"], "lr", [3.0])
    assert q is not None and q.name == "--q-lr"
