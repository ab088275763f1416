"""Run the unmodified script in this process as `__main__`, and tell how it ended.

`run_script` is the part of `nanguard run` that runs while the script does: it sets
`sys.argv` and `sys.path[0]` as `python -m cProfile` does, installs `Discovery`'s hooks and a
SIGTERM handler (`Terminated`, a `KeyboardInterrupt`: the script unwinds as on Ctrl-C), runs
the script with `runpy.run_path`, and in `finally`, whichever way the script stopped, removes
every hook and restores the handler, `sys.argv` and `sys.path`. It returns a `ScriptOutcome`:
`ok`, the script's own exit code (`sys.exit`, or `os._exit` in its main thread: `HardExit`
unwinds the script so that the record is written) or error, `stopped` by the `raise`
policy, `internal` (an error raised in nanguard's own code, told apart by the traceback's
innermost frame outside torch), `interrupted`, or `preflight` (`--preflight-only` stopped
it). While what the script
held is still alive (its globals; on an error, its traceback's frames) it also looks for a
non-finite value that no guarded step recorded (`ScriptOutcome.evidence`).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

from nanguard.audit.preflight_live import PreflightStop
from nanguard.errors import NanguardError
from nanguard.run import resume_child
from nanguard.run.discovery import Discovery
from nanguard.run.run_output import ScriptOutcome, say

__all__ = ["HardExit", "Terminated", "run_script", "torch_file"]


class Terminated(KeyboardInterrupt):
    """SIGTERM while the script runs: unwinds it like Ctrl-C (its own `except
    KeyboardInterrupt` and `finally` blocks run), then the run is written `interrupted`."""


class HardExit(BaseException):
    """`os._exit(code)` called by the script's main thread (to skip the interpreter's
    teardown): it unwinds the script instead, so that the record is closed, the report
    written and the summary printed; `nanguard run` then exits with `code` by `os._exit`
    itself. Forked children (DataLoader workers, multiprocessing) and other threads exit as
    they asked, untouched."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def run_script(script: Path, args: list[str], disc: Discovery) -> ScriptOutcome:
    """Run `script` as `__main__` with every hook installed; every hook removed afterwards.

    The end-of-run check for a non-finite value no step recorded runs here, while what the
    script held is still alive (its globals; on an error, the frames of its traceback)."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    outcome = ScriptOutcome()
    previous_term = _install_sigterm()
    real_exit = _install_hard_exit()
    try:
        sys.argv = [str(script), *args]
        script_dir = str(script.resolve().parent)
        if sys.path:
            sys.path[0] = script_dir
        else:
            sys.path.append(script_dir)
        disc.install()
        script_globals = runpy.run_path(str(script), run_name="__main__")
        _end_steps(disc)
        outcome.evidence = _evidence(disc, on_error=False)
        _attach_while_alive(disc, outcome)
        del script_globals
    except PreflightStop:
        outcome = ScriptOutcome("preflight", 0, "stopped after the preflight (--preflight-only)")
    except (SystemExit, HardExit) as exc:
        hard = isinstance(exc, HardExit)
        outcome = _system_exit(SystemExit(exc.code) if hard else exc)  # type: ignore[arg-type]
        outcome.hard_exit = hard
        _end_steps(disc)
        if outcome.kind != "ok":
            outcome.evidence = _evidence(disc, on_error=True)
        _attach_while_alive(disc, outcome)
    except KeyboardInterrupt as exc:
        sigterm = isinstance(exc, Terminated)
        outcome = ScriptOutcome("interrupted", 143 if sigterm else 130,
                                "SIGTERM" if sigterm else "KeyboardInterrupt")
        _end_steps(disc)
    except BaseException as exc:  # noqa: BLE001 - whatever the script raises is reported
        stop = _nanguard_error(exc)
        if stop is not None:
            outcome = ScriptOutcome("stopped", 1, str(stop))
        elif _raised_in_nanguard(exc, script):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            outcome = ScriptOutcome("internal", 1, f"{type(exc).__name__}: {exc}")
        else:
            _print_script_traceback(exc, script)
            outcome = ScriptOutcome("error", 1, f"{type(exc).__name__}: {exc}")
            _end_steps(disc)
            outcome.evidence = _evidence(disc, on_error=True, tb=exc.__traceback__)
            _attach_while_alive(disc, outcome)
        exc.__traceback__ = None  # let the script's frames (and tensors) go
    finally:
        # A resume point's child ends here, whichever way the script stopped in it.
        resume_child.child_done(outcome.message if outcome.kind != "ok" else None)
        disc.remove()
        os._exit = real_exit  # type: ignore[assignment]
        _restore_sigterm(previous_term)
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        sys.stdout.flush()
    return outcome


def _install_sigterm() -> tuple[bool, Any]:
    """SIGTERM raises `Terminated` in the main thread while the script runs. Returns (whether
    it was installed, the previous handler): not in the main thread, signals cannot be set."""

    def on_sigterm(signum: int, frame: Any) -> None:
        raise Terminated("SIGTERM")

    try:
        return True, signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
        return False, None


def _install_hard_exit() -> Callable[[int], NoReturn]:
    """`os._exit` raises `HardExit` in this process's main thread while the script runs.
    Returns the real one (restored afterwards, and what `nanguard run` exits by)."""
    real_exit = os._exit
    pid = os.getpid()

    def hard_exit(code: int) -> NoReturn:
        if os.getpid() == pid and threading.current_thread() is threading.main_thread():
            raise HardExit(code)
        real_exit(code)

    os._exit = hard_exit  # type: ignore[assignment]
    return real_exit


def _restore_sigterm(previous: tuple[bool, Any]) -> None:
    installed, handler = previous
    if installed:  # None: the previous handler was not set from Python; the default then
        signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def _end_steps(disc: Discovery) -> None:
    """End a pending hand-written step; never lets an error out (fail open)."""
    try:
        disc.finish()
    except Exception as exc:  # noqa: BLE001 - the run's record matters more
        say(f"could not end the last hand-written step: {type(exc).__name__}: {exc}")


def _evidence(disc: Discovery, *, on_error: bool, tb: TracebackType | None = None
              ) -> dict[str, Any] | None:
    if any(w.guard is not None and w.guard.first_nonfinite for w in disc.watched):
        return None  # already recorded by a step: nothing to add
    try:
        return disc.nonfinite_evidence(on_error=on_error, tb=tb)
    except Exception:  # noqa: BLE001 - a check at the end must never fail the run
        return None


def _attach_while_alive(disc: Discovery, outcome: ScriptOutcome) -> None:
    """With evidence of a non-finite value and no guard yet: attach the guard now, while the
    script's objects are still alive (its globals, or the traceback's frames). Discovery holds
    the optimizers and modules it saw weakly; once the script's namespace is gone, whether they
    survive to `late_finding` would depend on garbage-collection timing (a run whose first
    batch was NaN could be reported `unwatched` or not from one start to the next)."""
    if outcome.evidence is None:
        return
    with contextlib.suppress(Exception):  # fail open: the evidence is still reported
        disc.attach_unstepped()


def _system_exit(exc: SystemExit) -> ScriptOutcome:
    code = exc.code
    if code is None or code == 0:
        return ScriptOutcome()
    if isinstance(code, int):
        return ScriptOutcome("exit", code, f"exit code {code}")
    print(code, file=sys.stderr)  # what Python does with `sys.exit("message")`
    return ScriptOutcome("exit", 1, str(code))


def _nanguard_error(exc: BaseException) -> NanguardError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, NanguardError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


_PASS_THROUGH = ("backward", "wrapper", "clip_grad_norm_", "counted_start")
"""nanguard's wrappers around torch functions the script calls (`Tensor.backward`, the loss
functions, `torch.load`, `clip_grad_norm_`, `Process.start`): an error in them is torch's, or
the script's (`clip_grad_norm_(..., error_if_nonfinite=True)` raising on a NaN gradient)."""


def _raised_in_nanguard(exc: BaseException, script: Path) -> bool:
    """The exception came out of nanguard's own code (its hooks), not the script's: below the
    script's first frame, the innermost frame outside torch is nanguard's. The `backward`
    wrappers only pass autograd's errors on, as the `wrapper`s of the loss functions and of
    `torch.load` pass on theirs, and a closure nanguard runs first (LBFGS) is the script's
    code: none of these makes an error nanguard's."""
    if isinstance(exc, ValueError):
        # nanguard raises ValueError only for a user's mistake (a Guard(...) call with a
        # folder that holds a run, a misspelled setting): the script's error, not a bug.
        return False
    package = Path(__file__).resolve().parents[1]
    user_dirs = (package / "scenarios",)
    torch_dir = Path(torch_file()).resolve().parent
    target = script.resolve()
    tb, in_script, last_is_ours = exc.__traceback__, False, False
    while tb is not None:
        code = tb.tb_frame.f_code
        path = Path(code.co_filename).resolve()
        in_script = in_script or path == target
        if in_script and torch_dir not in path.parents and not code.co_filename.startswith("<"):
            ours = package in path.parents and not any(d in path.parents for d in user_dirs)
            if not (ours and code.co_name in _PASS_THROUGH):
                last_is_ours = ours
        tb = tb.tb_next
    return last_is_ours


def torch_file() -> str:
    """Where torch is installed (frames under it are neither the script's nor nanguard's)."""
    import torch

    return torch.__file__


def _print_script_traceback(exc: BaseException, script: Path) -> None:
    """The traceback as Python would print it, starting at the script's first frame."""
    target = script.resolve()
    tb = exc.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve() != target:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__, file=sys.stderr)
