"""`nanguard scan` and `scan_dataset`: planted NaN / Inf / extreme values found by row and
column in CSV, Parquet, .npy, .npz and torch files; bad labels; a constant column; a broken
one-hot group; streaming statistics equal to NumPy's whatever the chunking; exit codes."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from nanguard.audit import ScanConfig, scan_dataset, scan_file, scan_readers

N = 500


def _frame(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    cols = {f"f{i}": rng.normal(size=N) for i in range(5)}
    cols["const"] = np.full(N, 3.0)
    onehot = np.eye(4)[rng.integers(0, 4, N)]
    onehot[10] = [1, 1, 0, 0]
    onehot[20] = 0
    for j, c in enumerate(["red", "green", "blue", "gray"]):
        cols[f"color_{c}"] = onehot[:, j]
    y = rng.integers(0, 3, N).astype(float)
    y[42], y[43] = 3, -1
    cols["y"] = y
    return cols


def _codes(report) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in report.findings:
        out.setdefault(f.code, []).append(f)
    return out


def test_csv_nan_at_row_137_col_3_and_other_plants(tmp_path, cli):
    cols = _frame()
    cols["f3"][137] = np.nan
    cols["f1"][200] = np.inf
    cols["f2"][300] = 5e7
    cols["name"] = np.array(["a"] * N)
    pcsv.write_csv(pa.table(cols), tmp_path / "d.csv")
    report = scan_file(tmp_path / "d.csv", ScanConfig(label="y", num_classes=3))
    found = _codes(report)
    nan = found["nan"][0].details
    assert (nan["rows"], nan["column"], nan["column_name"]) == ([137], 3, "f3")
    assert found["posinf"][0].details["rows"] == [200]
    assert found["extreme"][0].details["rows"] == [300]
    assert found["zero_variance"][0].details["column_name"] == "const"
    assert found["label_out_of_range"][0].details["rows"] == [42, 43]
    assert found["onehot"][0].details["rows"] == [10, 20]
    assert found["skipped_columns"][0].severity == "info"
    code, out, _ = cli("scan", tmp_path / "d.csv", "--label", "y", "--num-classes", "3")
    assert code == 1 and "row 137" in out and "'f3'" in out


def test_parquet_inf_and_missing(tmp_path, cli):
    cols = _frame()
    cols["f0"][7] = -np.inf
    table = pa.table(cols)
    f4 = pa.array(cols["f4"], mask=np.arange(N) == 99)  # a null cell
    table = table.set_column(table.column_names.index("f4"), "f4", f4)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=128)
    found = _codes(scan_file(tmp_path / "d.parquet"))
    assert found["neginf"][0].details["rows"] == [7]
    assert found["missing"][0].details == {"column": 4, "column_name": "f4", "count": 1,
                                           "rows": [99]}  # fmt: skip
    code, out, _ = cli("scan", tmp_path / "d.parquet", "--format", "json")
    data = json.loads(out)
    assert code == 1 and data["tables"][0]["rows"] == N


def test_clean_file_exits_zero(tmp_path, cli):
    rng = np.random.default_rng(3)
    pq.write_table(pa.table({"a": rng.normal(size=50), "b": rng.normal(size=50)}),
                   tmp_path / "ok.parquet")  # fmt: skip
    code, out, _ = cli("scan", tmp_path / "ok.parquet")
    assert code == 0 and "no problems found" in out


def test_streaming_stats_equal_numpy_across_chunks(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.normal(loc=5.0, scale=2.0, size=(1000, 3))
    x[5, 1] = np.nan
    np.save(tmp_path / "x.npy", x)
    monkeypatch.setattr(scan_readers, "CHUNK_VALUES", 30)  # 10 rows per chunk
    cols = scan_file(tmp_path / "x.npy").tables[0].columns
    for j, c in enumerate(cols):
        assert c.mean == pytest.approx(np.nanmean(x[:, j]), rel=1e-12)
        assert c.std == pytest.approx(np.nanstd(x[:, j]), rel=1e-10)
        assert c.min == np.nanmin(x[:, j]) and c.max == np.nanmax(x[:, j])
    assert cols[1].count == 999 and cols[1].nan == 1


def test_npz_and_torch_files_with_labels(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, 4))
    x[137, 3] = np.nan
    y = rng.integers(0, 10, N)
    y[250] = 10
    np.savez(tmp_path / "d.npz", x=x, y=y)
    torch.save({"x": torch.tensor(x), "y": torch.tensor(y)}, tmp_path / "d.pt")
    for name in ("d.npz", "d.pt"):
        found = _codes(scan_file(tmp_path / name, ScanConfig(label="y", num_classes=10)))
        assert found["nan"][0].details["rows"] == [137]
        assert found["nan"][0].details["column_name"] == "x[3]"
        assert found["label_out_of_range"][0].details["rows"] == [250]


def test_explicit_onehot_is_strict_and_auto_ignores_multihot(tmp_path):
    rng = np.random.default_rng(4)
    tags = (rng.random((N, 3)) < 0.5).astype(float)  # independent flags, often 0 or 2+ ones
    cols = {"tag_a": tags[:, 0], "tag_b": tags[:, 1], "tag_c": tags[:, 2]}
    pq.write_table(pa.table(cols), tmp_path / "t.parquet")
    assert "onehot" not in _codes(scan_file(tmp_path / "t.parquet"))
    strict = _codes(scan_file(tmp_path / "t.parquet", ScanConfig(onehot=["tag_"])))
    assert strict["onehot"][0].severity == "error"


def test_scan_dataset_and_dataloader_report_sample_index():
    x = torch.randn(300, 6)
    x[137, 3] = float("nan")
    y = torch.randint(0, 5, (300,))
    y[42] = 7
    ds = torch.utils.data.TensorDataset(x, y)
    config = ScanConfig(label="1", num_classes=5)
    for source in (ds, torch.utils.data.DataLoader(ds, batch_size=32)):
        found = _codes(scan_dataset(source, config, batch_size=64))
        assert found["nan"][0].details["rows"] == [137]
        assert found["nan"][0].details["column_name"] == "0[3]"
        assert found["label_out_of_range"][0].details["rows"] == [42]


def test_dict_samples_name_columns():
    class DictDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"image": torch.full((2,), float(i)), "label": i % 2, "id": f"s{i}"}

    report = scan_dataset(DictDataset())
    assert [c.name for c in report.tables[0].columns] == ["image[0]", "image[1]", "label"]
    assert report.ok


def test_a_numeric_csv_column_with_stray_text_is_named(tmp_path, cli):
    """A spreadsheet export: one `#VALUE!` in a column of numbers. It used to be listed as
    "non-numeric, not scanned" (info); it is an error naming the row and the text. A real
    text column stays an info line."""
    rng = np.random.default_rng(0)
    lines = ["x,ratio,city"] + [f"{a:.4f},{b:.4f},paris" for a, b in rng.random((300, 2))]
    lines[1 + 56] = "0.5,#VALUE!,lyon"
    (tmp_path / "sheet.csv").write_text("\n".join(lines) + "\n")
    found = _codes(scan_file(tmp_path / "sheet.csv"))
    stray = found["non_numeric_values"][0]
    assert stray.severity == "error" and stray.details == {"numeric": 299,
                                                           "text": [[56, "#VALUE!"]]}
    assert "city" in found["skipped_columns"][0].message
    assert "ratio" not in found["skipped_columns"][0].message
    code, out, _ = cli("scan", tmp_path / "sheet.csv")
    assert code == 1 and "'#VALUE!'" in out and "row 56" in out
