"""Record: the crash-safe run store (SQLite, WAL) and report.json."""

from nanguard.record.report import Report, build_report, load_report
from nanguard.record.store import NullStore, RunStore, open_run

__all__ = ["NullStore", "Report", "RunStore", "build_report", "load_report", "open_run"]
