"""Which tests run on one xdist worker (tests/conftest.py's scheduler, `--dist loadgroup`).

Tests that share an expensive, once-per-process result run on one worker: otherwise each worker
that draws one of them builds it again."""

from __future__ import annotations

# Node id prefix -> group.
ONE_WORKER = {
    # docs/doc_shell.py runs each documented training command once per process: the pages'
    # and transcripts' 20 training commands are 9 distinct ones.
    "tests/docs/test_fenced_blocks.py": "docs-pages",
    # A module-scoped fixture that trains (or starts processes) for several tests.
    "tests/test_early_warning.py": "early-warning",
    "tests/test_live.py": "live",
    "tests/cli/test_cli_demo_report_replay.py": "demo-report-replay",
    "tests/integrations/test_torchrun.py": "torchrun",
    "tests/recover/test_lr_jump.py": "lr-jump",
    "tests/test_spike_measures_run.py": "spike-measures-run",
    "tests/explain/test_transient_verdict.py": "transient-verdict",
    "tests/frameworks/test_transformers_resume.py": "transformers-resume",
    "tests/frameworks/test_export_cli.py": "export-cli",
    "tests/programs/test_programs.py::test_gpt_resume": "gpt-checkpoint",
}


def one_worker_group(nodeid: str) -> str:
    """The group of a test: a key of `ONE_WORKER` its node id starts with, else its own."""
    return next((g for prefix, g in ONE_WORKER.items() if nodeid.startswith(prefix)), nodeid)
