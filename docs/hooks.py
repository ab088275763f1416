"""MkDocs hooks: the pages that are generated, not written, so they cannot drift from the code.

A page holds a marker comment where generated text goes:

- `<!-- generated: cli -->`: every subcommand's `--help`, as argparse prints it.
- `<!-- generated: report-schema -->`: report.json's keys from the shipped JSON Schema
  (src/nanguard/record/report.schema.json), one table per object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"


def _import_nanguard() -> None:
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))


def _cli() -> str:
    """Each command's --help in a code block (the parsers import no torch)."""
    _import_nanguard()
    from nanguard.cli.main import COMMANDS, build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    # argparse wraps to the terminal's width: fix it so the page is the same everywhere.
    import os

    os.environ["COLUMNS"] = "100"
    parts = ["## nanguard", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name in COMMANDS:
        sub = action.choices[name]
        parts += [f"## nanguard {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    kind = prop.get("type", "any")
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _table(obj: dict[str, Any]) -> list[str]:
    required = set(obj.get("required", []))
    rows = ["| key | type | required | meaning |", "| --- | --- | --- | --- |"]
    for key, prop in obj.get("properties", {}).items():
        text = str(prop.get("description", "")).replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{key}` | {_type(prop)} | {'yes' if key in required else ''} | {text} |")
    return rows


def _report_schema() -> str:
    schema = json.loads((SRC / "nanguard" / "record" / "report.schema.json").read_text())
    parts = [schema["description"], "", "## Top level", "", *_table(schema), ""]
    for name, sub in schema["$defs"].items():
        parts += [f"## {name}", ""]
        if sub.get("description"):
            parts += [sub["description"], ""]
        if "properties" in sub:
            parts += [*_table(sub), ""]
        elif "anyOf" in sub or "type" in sub:
            parts += [f"Type: {_type(sub)}", ""]
    parts += ["## The schema itself", "", "```json", json.dumps(schema, indent=2), "```", ""]
    return "\n".join(parts)


GENERATORS = {"cli": _cli, "report-schema": _report_schema}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    for name, make in GENERATORS.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
