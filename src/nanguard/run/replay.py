"""The re-run of `nanguard run`: the script again, with the op checker armed at one step.

    python -m nanguard.run.replay --step N --rng FILE --result FILE -- SCRIPT [ARGS]

Runs in its own process (started by `rerun.rerun_step`, which bounds it in time): restores the
RNG states the first run started from, runs the script as `__main__` under
`pinpoint.armed(N)` (N counts the steps of all optimizers together) and stops it as soon as
step N is over. Any `Guard` the script builds itself records nothing here (the first run
already did). Writes `{"origin": ..., "ran": ..., "steps_seen": ...}` to the result file.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from nanguard.pinpoint import armed
from nanguard.record import store
from nanguard.watch import loads, rng


def record_nothing() -> None:
    """In a re-run (this module's process, a resume point's child): any guard the script
    builds itself records nothing, so the user's run folders are never touched (the first run
    already recorded them)."""
    store.record_nothing()


class _Done(BaseException):
    """Raised from an optimizer hook once the armed step is over: stops the script."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanguard.run.replay")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--rng", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    script = Path(a.script)
    record_nothing()
    rng.restore(rng.loads(Path(a.rng).read_bytes()))
    result: dict[str, Any] = {}
    sys.argv = [str(script), *a.args]
    sys.path[0] = str(script.resolve().parent)
    loads.track()  # the files the data came from (`first_nonfinite.entered.file`)
    with armed(a.step, rank=a.rank) as state:

        def stop(*_: Any) -> None:
            if state.steps_seen > a.step:
                raise _Done

        handle = register_optimizer_step_post_hook(stop)
        try:
            runpy.run_path(str(script), run_name="__main__")
        except _Done:
            pass
        except BaseException as exc:  # noqa: BLE001 - the step may fail in the script's way
            result["script_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            handle.remove()
    loads.untrack()
    origin = state.origin.to_dict() if state.origin is not None else None
    result.update(origin=origin, ran=state.ran, steps_seen=state.steps_seen)
    Path(a.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
