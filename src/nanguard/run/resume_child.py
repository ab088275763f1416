"""A resume point's child once it got its "go" (run/resume.py): the checker armed at the
failing step, the script run on from where the fork left it, the origin written to the
result file, and the process gone right after that step (`os._exit`: none of the script's
cleanup, no atexit).

Only one module-level value: `CHILD`, set by `arm_child` and read by `child_done`, both here.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanguard.run.resume import Point

__all__ = ["CHILD", "arm_child", "child_done"]


@dataclass(kw_only=True)
class Child:
    """This process is a point's child that got its "go"."""

    result: Path
    step: int
    """The step armed, counted from entering `armed` in the child."""
    from_step: int
    state: Any = None
    context: Any = None


CHILD: Child | None = None
"""Set in a point's child once it goes on with the script (`run_script` then ends it
with `child_done` wherever the script stops)."""


def child_done(script_error: str | None = None) -> None:
    """End a point's child: its result written, the process gone (no cleanup of the
    script's runs, no atexit). Does nothing outside a child."""
    child = CHILD
    if child is None:
        return
    try:
        # Fills the origin of a step cut short; what was found is written all the same.
        with contextlib.suppress(Exception):
            child.context.__exit__(None, None, None)
        state = child.state
        origin = state.origin.to_dict() if state.origin is not None else None
        out = {"origin": origin, "ran": state.ran, "from_step": child.from_step}
        if script_error:
            out["script_error"] = script_error
        child.result.write_text(json.dumps(out))
    finally:
        os._exit(0)


def arm_child(point: Point, go: dict[str, Any]) -> None:
    """In a point's child, after the run's hooks are gone: arm the checker at the failing
    step and end the child right after it."""
    global CHILD
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from nanguard.pinpoint.armed import armed
    from nanguard.run import manual

    manual.own_hooks()
    # Counted from here: a real optimizer's step in progress is counted by the child's hook;
    # a hand-written one's began in the run's own boundaries, which are gone.
    step = int(go["step"]) - point.steps - (1 if point.manual else 0)
    assert step >= 0, (go, point)
    context = armed(step, expect_loss=go.get("expect_loss"))
    child = Child(result=Path(go["result"]), step=step, from_step=point.steps,
                  context=context)
    child.state = context.__enter__()
    CHILD = child

    def stop(*_: Any) -> None:
        if child.state.steps_seen > child.step:
            child_done()

    register_optimizer_step_post_hook(stop)
