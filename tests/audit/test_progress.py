"""Long reads say what they wait for: a folder scan over `PROGRESS_BYTES` prints one line on
stderr off a terminal (a progress bar on one), and a small one prints nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanguard.audit import folder


def _csvs(tmp_path: Path) -> Path:
    root = tmp_path / "shards"
    root.mkdir()
    for i in range(3):
        (root / f"part-{i}.csv").write_text("a,b\n" + "".join(f"{j},{j * i}\n" for j in range(50)))
    return root


def test_a_large_folder_says_what_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    root = _csvs(tmp_path)
    monkeypatch.setattr(folder, "PROGRESS_BYTES", 1)
    report = folder.scan_folder(root)
    assert len(report.files) == 3
    err = capsys.readouterr().err
    assert err.startswith("nanguard: reading 3 files (0.0 GiB) under ") and "(3 files) ..." in err


def test_a_small_folder_is_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = folder.scan_folder(_csvs(tmp_path))
    assert len(report.files) == 3
    assert capsys.readouterr().err == ""
