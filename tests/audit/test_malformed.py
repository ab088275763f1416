"""Malformed inputs to audit / scan / lint: each gives exit code 2 and exactly one line on
stderr, never a traceback. Two run as real processes to prove it end to end."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from audit_helpers import assert_one_line_error, run_subprocess


def _pt(p: Path) -> None:
    torch.save({"w": torch.ones(4)}, p)


def _truncated(make: Callable[[Path], None], keep: float) -> Callable[[Path], None]:
    def write(p: Path) -> None:
        make(p)
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])

    return write


def _st(p: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(64)}, p)


def _npy(p: Path) -> None:
    np.save(p, np.ones((10, 3)))


def _bad_npy_header(p: Path) -> None:
    _npy(p)
    data = bytearray(p.read_bytes())
    data[10:20] = b"{'descr': "[:10].replace(b"d", b"?")
    p.write_bytes(bytes(data))


def _parquet(p: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": [1.0, 2.0]}), p)


def _bytes(data: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(data)


def _text(data: str) -> Callable[[Path], None]:
    return lambda p: p.write_text(data)


def _mkdir(p: Path) -> None:
    p.mkdir()


def _header_only_safetensors(p: Path) -> None:
    header = b'{"w":{"dtype":"F32","shape":[1000],"data_offsets":[0,4000]}}'
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 100)


def _ragged_late(p: Path) -> None:
    p.write_text("a,b\n" + "1,2\n" * 5 + "1,2,3\n")


def _object_npy(p: Path) -> None:
    np.save(p, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)


CASES: list[tuple[str, str, str, Callable[[Path], None] | None]] = [
    # (id, command, file name, writer; None = the file does not exist)
    ("audit-missing", "audit", "nope.pt", None),
    ("audit-dir", "audit", "ckpt_dir", _mkdir),
    ("audit-empty-pt", "audit", "e.pt", _bytes(b"")),
    ("audit-empty-st", "audit", "e.safetensors", _bytes(b"")),
    ("audit-garbage-pt", "audit", "g.pt", _bytes(os.urandom(4096))),
    ("audit-garbage-st", "audit", "g.safetensors", _bytes(b"\xff" * 64)),
    ("audit-truncated-pt", "audit", "t.pt", _truncated(_pt, 0.5)),
    ("audit-truncated-pt-head", "audit", "t2.pt", _truncated(_pt, 0.05)),
    ("audit-truncated-st", "audit", "t.safetensors", _truncated(_st, 0.5)),
    ("audit-st-short-data", "audit", "s.safetensors", _header_only_safetensors),
    ("audit-text-file", "audit", "model.txt", _text("just some notes\n")),
    ("audit-csv-as-ckpt", "audit", "data.csv", _text("a,b\n1,2\n")),
    ("audit-zip-not-torch", "audit", "z.pt", _bytes(b"PK\x03\x04" + b"\0" * 60)),
    ("scan-missing", "scan", "nope.csv", None),
    ("scan-dir", "scan", "data_dir.csv", _mkdir),
    ("scan-empty-csv", "scan", "e.csv", _bytes(b"")),
    ("scan-header-only-csv", "scan", "h.csv", _text("a,b,c\n")),
    ("scan-ragged-csv", "scan", "r.csv", _text("a,b,c\n1,2,3\n4,5\n")),
    ("scan-ragged-late-csv", "scan", "r2.csv", _ragged_late),
    ("scan-non-utf8-header", "scan", "u.csv", _bytes(b"a,\xff\xfeb\n1,2\n")),
    ("scan-non-utf8-cell", "scan", "u2.csv", _bytes(b"a,b\n1,\xff\xfe\n")),
    ("scan-wrong-extension", "scan", "data.xlsx", _bytes(b"PK\x03\x04")),
    ("scan-no-extension", "scan", "data", _text("a\n1\n")),
    ("scan-garbage-parquet", "scan", "g.parquet", _bytes(os.urandom(256))),
    ("scan-truncated-parquet", "scan", "t.parquet", _truncated(_parquet, 0.6)),
    ("scan-corrupt-npy-header", "scan", "c.npy", _bad_npy_header),
    ("scan-truncated-npy", "scan", "t.npy", _truncated(_npy, 0.7)),
    ("scan-garbage-npy", "scan", "g.npy", _bytes(os.urandom(200))),
    ("scan-object-npy", "scan", "o.npy", _object_npy),
    ("scan-garbage-npz", "scan", "g.npz", _bytes(os.urandom(200))),
    ("scan-garbage-pt", "scan", "g.pt", _bytes(os.urandom(200))),
    ("scan-truncated-pt", "scan", "t.pt", _truncated(_pt, 0.5)),
    ("lint-missing", "lint", "nope.py", None),
    ("lint-non-utf8", "lint", "bad.py", _bytes(b"x = '\xff\xfe'\n")),
    ("lint-syntax-error", "lint", "syn.py", _text("def f(:\n    pass\n")),
    ("lint-null-bytes", "lint", "nul.py", _bytes(b"x = 1\0\n")),
    ("lint-wrong-extension", "lint", "train.txt", _text("import torch\n")),
    ("lint-bad-coding-cookie", "lint", "cookie.py", _text("# -*- coding: nope -*-\nx = 1\n")),
]


@pytest.mark.parametrize(("command", "name", "write"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_malformed_input_is_one_line_error(tmp_path, cli, command, name, write):
    path = tmp_path / name
    if write is not None:
        write(path)
    code, out, err = cli(command, path)
    assert_one_line_error(code, err)
    assert str(path.name) in err or "no such" in err


def test_user_errors_in_arguments(tmp_path, cli):
    (tmp_path / "d.csv").write_text("a,b\n1,2\n3,4\n")
    for args in (["--label", "zzz"], ["--num-classes", "3"], ["--onehot", "q_"],
                 ["--label", "a", "--num-classes", "0"]):  # fmt: skip
        code, _, err = cli("scan", tmp_path / "d.csv", *args)
        assert_one_line_error(code, err)
    code, _, err = cli("lint")
    assert_one_line_error(code, err)


def test_malformed_inputs_in_real_processes(tmp_path):
    (tmp_path / "r.csv").write_text("a,b,c\n1,2,3\n4,5\n")
    proc = run_subprocess("scan", tmp_path / "r.csv")
    assert_one_line_error(proc.returncode, proc.stderr)
    (tmp_path / "bad.py").write_bytes(b"x = '\xff'\n")
    proc = run_subprocess("lint", tmp_path / "bad.py")
    assert_one_line_error(proc.returncode, proc.stderr)
    assert proc.stdout == ""
