"""The op table and where a value entered, on realistic programs run black box through `nanguard
run` (the command's `main` in the test's process, the scripts unmodified, the fault through a
flag or a data file): a PPO with a rollout buffer, a tiny DDPM, and a regression read from CSV /
`.pt` files through a DataLoader.

The expected finding is established without nanguard: each script prints `NOTE ... at update
K` from its own arithmetic (a minibatch of one, `half - 1 == 0`, returns beyond float32 in
float64, a batch holding NaN in its target column), and the op's line is found in the script's
own text. nanguard must report `failed` at step K with that cause, op and line.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from programs_support import SCRIPTS, finding_of, guarded, noted, script_where


def _make(cwd: Path, name: str, *flags: str) -> None:
    """`file_regression.py --make NAME FLAGS` in `cwd`: the script's own data-file writer, run
    in this process (writing a file needs no interpreter of its own; the training runs black
    box)."""
    script = str(SCRIPTS / "file_regression.py")
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [script, "--make", name, *flags]
    os.chdir(cwd)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    assert (cwd / name).is_file()


PPO = "ppo_rollout.py"


def test_ppo_minibatch_of_one_is_std_over_n_le_correction(tmp_path: Path) -> None:
    """`--rollout 33 --minibatch 8`: the last minibatch holds one transition and `adv.std()`
    divides by n - 1 = 0 (was: op and line right, cause undetermined)."""
    g = guarded(tmp_path, PPO, "--rollout", "33", "--iters", "2")
    want = {"status": "failed", "step": noted(g, "minibatch of 1"), "op": "aten.std",
            "source": script_where(PPO, "(adv - adv.mean()) / (adv.std()"),
            "cause": "division_by_zero"}
    assert finding_of(g) == want, g.explain()
    top = g.report["diagnosis"][0]
    assert "n - correction = 0" in top["evidence"] and "correction=0" in top["fix"]


def test_ppo_returns_beyond_float32_enter_at_their_tensor(tmp_path: Path) -> None:
    """`--returns python --gamma 9.9`: the returns, summed in Python floats, exceed float32;
    `torch.tensor(rets)` holds inf, and the origin is that line (was: a later `sub` that made
    NaN of it, cause undetermined)."""
    g = guarded(tmp_path, PPO, "--returns", "python", "--gamma", "9.9", "--rollout", "48",
                "--iters", "1")
    want = {"status": "failed", "step": noted(g, "returns overflow float32"),
            "op": "aten.lift_fresh", "source": script_where(PPO, "torch.tensor(rets)"),
            "cause": "cast_overflow"}
    assert finding_of(g) == want, g.explain()
    assert g.report["first_nonfinite"]["entered"]["how"] == "tensor"


DDPM = "tiny_diffusion.py"


def test_ddpm_time_embedding_divides_by_a_python_zero(tmp_path: Path) -> None:
    """`--time-dim 2`: `arange(half) / (half - 1)` with half = 1 divides by the Python int 0,
    which is not among the op's tensor inputs."""
    g = guarded(tmp_path, DDPM, "--time-dim", "2", "--steps", "3")
    want = {"status": "failed", "step": noted(g, "half-1 = 0"), "op": "aten.div",
            "source": script_where(DDPM, "dtype=torch.float32) / (half - 1)"),
            "cause": "division_by_zero"}
    assert finding_of(g) == want, g.explain()
    assert g.report["first_nonfinite"]["args"] == {"other": 0}


REG = "file_regression.py"


def test_batch_norm_over_a_last_batch_of_one_row(tmp_path: Path) -> None:
    """`--norm batch --batch 19` on 96 rows: the DataLoader's last batch holds one row and
    `xb.std(0)` divides by n - 1 = 0: a second program for n <= correction."""
    _make(tmp_path, "train.csv")
    g = guarded(tmp_path, REG, "--data", "train.csv", "--norm", "batch", "--batch", "19",
                "--epochs", "2")
    want = {"status": "failed", "step": noted(g, "batch of 1"), "op": "aten.std",
            "source": script_where(REG, "xb.std(0)"), "cause": "division_by_zero"}
    assert finding_of(g) == want, g.explain()


def test_nan_target_in_a_csv_is_a_label_named_at_the_loss(tmp_path: Path) -> None:
    """An empty target cell (NumPy reads it as NaN) reaches `mse_loss` as its target: a label,
    read from train.csv (was: undetermined / data)."""
    _make(tmp_path, "train.csv", "--nan-row", "37", "--nan-col", "4")
    g = guarded(tmp_path, REG, "--data", "train.csv", "--epochs", "1")
    first = g.report["first_nonfinite"]
    got = {**finding_of(g), "entered": first.get("entered")}
    want = {"status": "failed", "step": noted(g, "nan in target"), "op": "aten.stack",
            "source": Path(got["source"]).name, "cause": "label_nonfinite",
            "entered": {"how": "target", "op": "aten.mse_loss", "file": "train.csv",
                        "read": "numpy", "source": first["entered"]["source"]}}
    assert got == want, g.explain()
    assert Path(first["entered"]["source"]).name == script_where(REG, "mse_loss(")
    assert "`nanguard scan train.csv`" in g.report["diagnosis"][0]["fix"]


def test_a_data_file_read_with_torch_load_is_data_not_a_checkpoint(tmp_path: Path) -> None:
    """Features with a NaN saved as tensors and read by `torch.load('train.pt')`, the whole
    file one batch: the value entered at the `torch.load` line and is data (was:
    checkpoint_nonfinite); the fix scans that file."""
    _make(tmp_path, "train.pt", "--nan-row", "37", "--nan-col", "1")
    g = guarded(tmp_path, REG, "--data", "train.pt", "--batch", "0", "--epochs", "1")
    want = {"status": "failed", "step": noted(g, "nan in features"),
            "op": g.report["first_nonfinite"]["op"],
            "source": script_where(REG, "torch.load(path"), "cause": "data_nonfinite"}
    assert finding_of(g) == want, g.explain()
    assert "`nanguard scan train.pt`" in g.report["diagnosis"][0]["fix"]


def test_a_float64_value_beyond_float32_overflows_at_the_cast(tmp_path: Path) -> None:
    """A 1e40 in the CSV (fine in NumPy's float64) becomes inf at `.float()`: the cast is the
    origin, named with the file to scan."""
    _make(tmp_path, "train.csv", "--huge", "37")
    g = guarded(tmp_path, REG, "--data", "train.csv", "--batch", "0", "--epochs", "1")
    assert "NOTE beyond float32 in the file" in g.proc.stdout
    want = {"status": "failed", "step": 0, "op": "aten._to_copy",
            "source": script_where(REG, "torch.from_numpy(table[:, :4]).float()"),
            "cause": "cast_overflow"}
    assert finding_of(g) == want, g.explain()
    assert "`nanguard scan train.csv`" in g.report["diagnosis"][0]["fix"]
