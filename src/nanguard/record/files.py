"""The names of a run folder's files (one place, imported by the store, the report and the
measures without importing one another)."""

DB_NAME = "run.db"
"""The run store (SQLite, WAL)."""
REPORT_NAME = "report.json"
"""The report, written when the run closes."""
