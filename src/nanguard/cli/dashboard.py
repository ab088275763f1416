"""`nanguard dashboard DIR [--port P]`: serve the HTML report of the runs under DIR on
127.0.0.1, live: a run that is still training updates in the page every 2 s.

The run stores are read through read-only SQLite connections while the training writes them
(WAL mode: readers never block the writer). Only the standard library's http.server is used.
Ctrl-C stops the server cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, urlparse

from nanguard.cli.main import add_command
from nanguard.record.report import REPORT_NAME
from nanguard.record.store import DB_NAME

if TYPE_CHECKING:  # http.server is imported when the dashboard serves, not by every command
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_DEPTH = 4
"""How deep under DIR run folders are looked for."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "dashboard", help="serve live HTML reports of the runs under DIR",
        description=__doc__, ok="stopped with Ctrl-C",
        one="not used (the dashboard shows runs; it does not judge them)",
        two="bad arguments, DIR is not a folder, or the port is taken")
    p.add_argument("dir", help="a folder holding run folders (or one run folder)")
    p.add_argument("--port", type=int, default=8765,
                   help="port on 127.0.0.1 (default 8765; 0: any free port)")
    p.set_defaults(func=run)


def find_runs(root: Path) -> list[Path]:
    """Run folders (holding run.db or report.json) under `root`, itself included."""
    out: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            return
        if (d / DB_NAME).is_file() or (d / REPORT_NAME).is_file():
            out.append(d)
        if depth < MAX_DEPTH:
            for e in entries:
                if e.is_dir() and not e.name.startswith("."):
                    walk(e, depth + 1)

    walk(root, 0)
    return out


def _run_info(root: Path, folder: Path) -> dict[str, Any]:
    """One line of the index: path, status, steps, last change."""
    rel = folder.relative_to(root).as_posix() or "."
    info: dict[str, Any] = {"path": rel, "status": "running", "steps": None}
    mtimes = [p.stat().st_mtime for p in (folder / DB_NAME, folder / (DB_NAME + "-wal"),
                                           folder / REPORT_NAME) if p.exists()]
    info["modified"] = max(mtimes, default=0.0)
    try:
        if (folder / REPORT_NAME).is_file():
            data = json.loads((folder / REPORT_NAME).read_text())
            info["status"], info["steps"] = data.get("status"), data.get("steps")
        else:
            from nanguard.record.report import load_report
            from nanguard.show.series import step_range

            # No report.json yet: `running` while its process lives, else `died` (as `nanguard
            # report` says it).
            info["status"] = load_report(folder).status
            lo, hi = step_range(folder)
            info["steps"] = max(0, hi - lo + 1)
    except (OSError, ValueError) as exc:
        info["status"] = f"unreadable ({exc})"
    return info


class Dashboard:
    """What the server shows: the runs under `root`, their pages and data (cached until a
    run's files change)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._cache: dict[str, tuple[tuple[float, ...], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def resolve(self, rel: str) -> Path:
        """The run folder `rel` names, which must lie under the root."""
        folder = (self.root / rel).resolve()
        if folder != self.root and self.root not in folder.parents:
            raise ValueError(f"{rel!r} is outside the dashboard folder")
        if not ((folder / DB_NAME).is_file() or (folder / REPORT_NAME).is_file()):
            raise ValueError(f"{rel!r} is not a nanguard run folder")
        return folder

    def data(self, rel: str) -> dict[str, Any]:
        """The page data of one run (header, figure, meta), rebuilt when its files change."""
        from nanguard.show.html import load_sources, payload

        folder = self.resolve(rel)
        key = tuple(p.stat().st_mtime_ns if p.exists() else 0.0
                    for p in (folder / DB_NAME, folder / (DB_NAME + "-wal"), folder / REPORT_NAME))
        with self._lock:
            hit = self._cache.get(rel)
        if hit and hit[0] == key:
            return hit[1]
        out = payload(load_sources([str(folder)], live=True))
        out["meta"] += f" (live, read {time.strftime('%H:%M:%S')})"
        with self._lock:
            self._cache[rel] = (key, out)
        return out

    def page(self, rel: str) -> str:
        from nanguard.show.html import render_page

        return render_page(rel, self.data(rel), live=f"/api/run?path={quote(rel)}")

    def index(self) -> str:
        runs = [_run_info(self.root, f) for f in find_runs(self.root)]
        e = html.escape
        rows = "".join(
            f'<tr><td><a href="/run?path={quote(r["path"])}">{e(r["path"])}</a></td>'
            f'<td class="status">{e(str(r["status"]))}</td><td>{e(str(r["steps"]))}</td>'
            f'<td>{time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["modified"]))}</td></tr>'
            for r in runs
        )
        return (
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta http-equiv="refresh" content="5"><title>nanguard dashboard</title><style>'
            "body{font-family:system-ui,sans-serif;margin:16px 24px}td,th{padding:3px 12px;"
            "text-align:left}</style></head><body>"
            f"<h1>nanguard dashboard — {e(str(self.root))}</h1>"
            f"<table id=\"runs\"><tr><th>run</th><th>status</th><th>steps</th><th>changed</th>"
            f"</tr>{rows}</table>{'' if runs else '<p>no runs yet</p>'}</body></html>"
        )


def make_handler(board: Dashboard) -> type[BaseHTTPRequestHandler]:
    """The request handler class serving `board`."""
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            rel = parse_qs(url.query).get("path", ["."])[0]
            try:
                if url.path == "/":
                    self._send(200, "text/html", board.index())
                elif url.path == "/run":
                    self._send(200, "text/html", board.page(rel))
                elif url.path == "/api/run":
                    self._send(200, "application/json", json.dumps(board.data(rel)))
                elif url.path == "/api/runs":
                    runs = [_run_info(board.root, f) for f in find_runs(board.root)]
                    self._send(200, "application/json", json.dumps(runs))
                elif url.path == "/favicon.ico":
                    self._send(204, "image/x-icon", "")
                else:
                    self._send(404, "text/plain", "not found")
            except ValueError as exc:
                self._send(404, "text/plain", str(exc))
            except Exception as exc:  # a run store mid-write must not kill the server
                self._send(500, "text/plain", f"{type(exc).__name__}: {exc}")

        def _send(self, code: int, kind: str, body: str) -> None:
            data = body.encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

    return Handler


def serve(root: str, port: int = 8765) -> ThreadingHTTPServer:
    """A server for the runs under `root` on 127.0.0.1 (not started: call serve_forever).

    Raises:
        ValueError: one line, if `root` is not a folder or the port cannot be bound.
    """
    from http.server import ThreadingHTTPServer

    path = Path(root)
    if not path.is_dir():
        raise ValueError(f"{root!r} is not a folder")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: pass a port in 0..65535")
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(Dashboard(path)))
    except OSError as exc:
        raise ValueError(f"cannot listen on 127.0.0.1:{port} ({exc.strerror or exc})") from None
    server.daemon_threads = True
    return server


def run(args: argparse.Namespace) -> int:
    server = serve(args.dir, args.port)
    host, port = server.server_address[:2]
    print(f"nanguard dashboard: runs under {args.dir} at http://{host!s}:{port}/ "
          "(Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("nanguard dashboard: stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
