"""Writes the transcripts of README.md and docs/ from real runs, so none can go stale.

A transcript is a `text` block under `<!-- transcript: COMMAND -->` (or `... (first N lines)
-->`): this script runs COMMAND in a terminal of 100 columns, in a fresh folder holding a copy
of examples/ (after the block's `<!-- setup: ... -->` commands), and writes what it printed
into the block: `$ COMMAND`, then the output. tests/docs/test_fenced_blocks.py runs each
command again and fails when the committed block differs (dates, durations and temporary
paths aside).

    python docs/transcripts.py            # rewrite every transcript
    python docs/transcripts.py --check    # exit 1 naming each transcript that is stale
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import doc_blocks as blocks  # noqa: E402
import doc_shell as shell  # noqa: E402


def produce(block: blocks.Block, folder: Path) -> str:
    """The text a transcript block should hold, from a fresh run in `folder`."""
    assert block.transcript is not None
    work = shell.workspace(folder)
    for command in block.setup:
        result = shell.run(command, work)
        if result.returncode != 0:
            raise RuntimeError(f"{block.where}: setup `{command}` exited "
                               f"{result.returncode}:\n{result.output}")
    result = shell.run(block.transcript, work, tty=True)
    lines = result.output.strip("\n").splitlines()
    if block.first_lines is not None and len(lines) > block.first_lines:
        lines = [*lines[:block.first_lines], "..."]
    return "\n".join([f"$ {block.transcript}", *lines])


def replace(path: Path, block: blocks.Block, text: str) -> None:
    lines = path.read_text().splitlines()
    start = block.line  # the line after the opening fence, 0-based
    end = start
    while lines[end].strip() != "```":
        end += 1
    lines[start:end] = text.splitlines()
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) the docs' transcripts.")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = 0
    for page in blocks.pages():
        # Bottom up, so the line numbers of the blocks above stay right while rewriting.
        for block in reversed([b for b in blocks.parse(page) if b.transcript is not None]):
            with tempfile.TemporaryDirectory(prefix="nanguard-transcript-") as tmp:
                fresh = produce(block, Path(tmp))
            if shell.normalise(fresh) == shell.normalise(block.text):
                continue
            stale += 1
            print(f"{block.where}: {'stale' if args.check else 'rewritten'}: "
                  f"{block.transcript}")
            if not args.check:
                replace(page, block, fresh)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
