"""The fenced code blocks of README.md and docs/, and the markers that say how each one is run.

Every block is run by tests/docs/test_fenced_blocks.py, or carries a visible reason why not.
A block's markers are HTML comments on the lines right above its opening fence:

- `<!-- not run: REASON -->`: the block is not run (a multi-process torchrun, a server that
  serves until Ctrl-C, an install into a fresh environment); the collector counts these.
  `<!-- not run (lines 1, 4): REASON -->` leaves out those lines of the block and runs the rest.
- `<!-- transcript: COMMAND -->` (optionally ending `(first N lines)`): a `text` block that is
  what COMMAND prints in a terminal, written by docs/transcripts.py from a real run; the test
  runs COMMAND again and compares (timings, dates and paths normalised).
- `<!-- run with: NAME -->`: a `python` block is executed with the names that
  `examples/snippets.py` function NAME returns (a tiny model, optimizer, loader, ...).
- `<!-- setup: COMMAND -->`: COMMAND runs in the page's folder before the block (sample files).

`python` blocks are executed; `bash` / `console` blocks run command by command, in a folder of
their page holding a copy of examples/ (so `nanguard run examples/train.py` works as it does
in a clone), with `nanguard` resolved as `python -m nanguard` from this checkout. A block with
no marker that cannot be run (`text`, no language) is an error: a block is run or says why not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL = ("bash", "console", "sh", "shell")

_FENCE = re.compile(r"^```([\w-]*)\s*$")
_COMMENT = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")
_NOT_RUN = re.compile(r"^not run(?: \(lines? ([\d, ]+)\))?:\s*(.+)$")
_FIRST = re.compile(r"^(.*?)\s*\(first (\d+) lines\)$")


@dataclass
class Block:
    """One fenced block, where it is, and what its markers say."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    not_run: str | None = None  # the reason, when the whole block (or some lines) is not run
    skip_lines: set[int] = field(default_factory=set)  # 1-based lines within the block
    transcript: str | None = None  # the command whose output the block shows
    first_lines: int | None = None
    context: str | None = None
    setup: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether some of the block is executed (a transcript is checked, not run here)."""
        whole = self.not_run is not None and not self.skip_lines
        return not whole and self.transcript is None and self.lang in ("python", *SHELL)


def pages() -> list[Path]:
    """README.md and every docs page but the contributor guide (its commands are for a clone
    with the dev set-up, and CI runs them itself)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "contributing.md")
    return [ROOT / "README.md", *docs]


def parse(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the markers right above it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        block = Block(path=path, line=i + 1, lang=m.group(1), text="\n".join(lines[i + 1:end]))
        j = i - 1
        while j >= 0 and (c := _COMMENT.match(lines[j])):
            _apply(block, c.group(1))
            j -= 1
        _check(block)
        blocks.append(block)
        i = end + 1
    return blocks


def _apply(block: Block, marker: str) -> None:
    if (m := _NOT_RUN.match(marker)):
        block.not_run = m.group(2)
        if m.group(1):
            block.skip_lines = {int(n) for n in re.split(r"[,\s]+", m.group(1).strip())}
    elif marker.startswith("transcript:"):
        command = marker.removeprefix("transcript:").strip()
        if (f := _FIRST.match(command)):
            command, block.first_lines = f.group(1), int(f.group(2))
        block.transcript = command
    elif marker.startswith("run with:"):
        block.context = marker.removeprefix("run with:").strip()
    elif marker.startswith("setup:"):
        block.setup.insert(0, marker.removeprefix("setup:").strip())
    elif not marker.startswith(("generated:", "/")):
        block.errors.append(f"unknown marker <!-- {marker} -->")


def _check(block: Block) -> None:
    if block.transcript is not None and block.lang != "text":
        block.errors.append("a transcript is a `text` block")
    if block.context and block.lang != "python":
        block.errors.append("`run with:` is for python blocks")
    if block.not_run is None and block.transcript is None and block.lang not in ("python", *SHELL):
        block.errors.append(
            f"a `{block.lang or 'no language'}` block is neither run nor marked: make it a "
            "transcript (<!-- transcript: COMMAND -->) or say why not (<!-- not run: why -->)")


def commands(block: Block) -> list[str]:
    """The shell commands of a bash/console block, in order, without the lines marked not run
    (continuation lines joined; `$ ` prompts dropped; comment-only lines skipped)."""
    out: list[str] = []
    pending = ""
    for n, raw in enumerate(block.text.splitlines(), start=1):
        if n in block.skip_lines:
            continue
        line = raw.removeprefix("$ ") if block.lang == "console" else raw
        if block.lang == "console" and not raw.startswith("$ ") and not pending:
            continue  # output shown in a console block
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


def python_source(block: Block) -> str:
    """A python block's code without the lines marked not run."""
    return "\n".join(
        line for n, line in enumerate(block.text.splitlines(), start=1)
        if n not in block.skip_lines)
