"""Every fenced block of README.md and docs/ runs as written, or says visibly why it cannot.

The collector (docs/doc_blocks.py) reads each page's blocks and the markers above them. Per page,
the `python` blocks are executed and the `bash` / `console` blocks run command by command in
a terminal, in one folder holding a copy of examples/ (so a later block reads the run an
earlier one recorded, as a reader's folder would); every transcript (`text` block under
`<!-- transcript: COMMAND -->`) is compared with a fresh run of its command, so none can go
stale (`python docs/transcripts.py` rewrites them). A training command is run once per test
process and shared between pages (docs/doc_shell.py).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))

import doc_blocks as blocks  # noqa: E402
import doc_shell as shell  # noqa: E402
import transcripts  # noqa: E402

PAGES = {page: blocks.parse(page) for page in blocks.pages()}
RUN_PAGES = [page for page, found in PAGES.items() if any(b.runs for b in found)]
TRANSCRIPTS = [b for found in PAGES.values() for b in found if b.transcript is not None]
# What a documented command may exit with: 0, or 1 where it shows a failed run or a problem
# found (the docs show those on purpose). 2 (a mistake in the command) or 3 (a bug) never.
EXITS = (0, 1)
_SAYS_EXIT = re.compile(r"\s#\s*exit (\d+)\b")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_block_is_run_or_marked() -> None:
    all_blocks = [b for found in PAGES.values() for b in found]
    errors = [f"{b.where}: {e}" for b in all_blocks for e in b.errors]
    assert not errors, "\n".join(errors)
    ran = [b for b in all_blocks if b.runs]
    checked = [b for b in all_blocks if b.transcript is not None]
    marked = [b for b in all_blocks if b.not_run is not None]
    # Every block is counted once as run, checked or not run (a partly run block is both).
    assert {id(b) for b in all_blocks} == {id(b) for b in ran + checked + marked}
    assert all(b.not_run and len(b.not_run) > 8 for b in marked), "say why a block is not run"
    assert "README.md" in {_rel(b.path) for b in checked}


def _snippets() -> Any:
    spec = importlib.util.spec_from_file_location("snippets", ROOT / "examples" / "snippets.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exec_python(block: blocks.Block, work: Path) -> None:
    import nanguard

    old = os.getcwd()
    os.chdir(work)
    names: dict[str, Any] = {"__name__": "__docs__"}
    try:
        if block.context:
            names.update(getattr(_snippets(), block.context)())
        code = compile(blocks.python_source(block), block.where, "exec")
        exec(code, names)  # noqa: S102 - the docs' own snippets
    finally:
        for value in list(names.values()):
            if isinstance(value, nanguard.Guard):
                with contextlib.suppress(ValueError):  # closed already, as the snippet said
                    value.close()
        if callable(names.get("close_ddp")):  # the process group `run with: ddp` made
            names["close_ddp"]()
        os.chdir(old)


@pytest.mark.parametrize("page", RUN_PAGES, ids=_rel)
def test_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    work = shell.workspace(tmp_path)
    done_setup: set[str] = set()
    for block in PAGES[page]:
        if not block.runs:
            continue
        for command in block.setup:
            if command not in done_setup:
                result = shell.run(command, work)
                assert result.returncode == 0, f"{block.where}: setup {command}\n{result.output}"
                done_setup.add(command)
        if block.lang == "python":
            _exec_python(block, work)
            continue
        for command in blocks.commands(block):
            result = shell.run(command, work, tty=True)
            shown = f"{block.where}: `{command}` exited {result.returncode}:\n{result.output}"
            said = _SAYS_EXIT.search(command)  # "# exit 1: ..." states the code exactly
            assert result.returncode in ((int(said.group(1)),) if said else EXITS), shown
            assert "Traceback (most recent call last)" not in result.output, shown


@pytest.mark.parametrize("block", TRANSCRIPTS, ids=lambda b: b.where)
def test_transcript_is_what_the_command_prints(block: blocks.Block, tmp_path: Path) -> None:
    fresh = shell.normalise(transcripts.produce(block, tmp_path))
    committed = shell.normalise(block.text)
    diff = "\n".join(difflib.unified_diff(committed.splitlines(), fresh.splitlines(),
                                          "committed", "fresh run", lineterm=""))
    assert fresh == committed, (f"{block.where} is stale: run `python docs/transcripts.py`\n"
                                f"{diff}")


def test_the_collector_refuses_a_block_neither_run_nor_marked(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```text\nsome output\n```\n\n<!-- not run: serves until Ctrl-C -->\n"
                    "```bash\nnanguard dashboard runs/\n```\n\n"
                    "<!-- not run (line 2): two GPUs -->\n"
                    "```bash\nnanguard report runs/x  # shown\ntorchrun x.py\n```\n"
                    "<!-- transcript: nanguard demo (first 3 lines) -->\n```text\n$ x\n```\n")
    bare, marked, partly, transcript = blocks.parse(page)
    assert bare.errors and "neither run nor marked" in bare.errors[0]
    assert not marked.errors and not marked.runs and marked.not_run == "serves until Ctrl-C"
    assert partly.runs and blocks.commands(partly) == ["nanguard report runs/x  # shown"]
    assert transcript.transcript == "nanguard demo" and transcript.first_lines == 3


def test_normalising_a_transcript_keeps_what_matters() -> None:
    a = "nanguard: failed after 30 steps — record in nanguard_runs/20261206-030354 (4.2 s)"
    b = "nanguard: failed after 30 steps — record in nanguard_runs/20261207-110000 (0.9 s)"
    assert shell.normalise(a) == shell.normalise(b)
    assert shell.normalise(a) != shell.normalise(a.replace("30 steps", "29 steps"))
