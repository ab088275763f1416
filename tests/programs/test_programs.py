"""Realistic training programs run black box through `nanguard run` (the command's `main` in the
test's process, the scripts unmodified): a nanoGPT-style GPT (AdamW, warm-up + cosine, clipping,
checkpoint resume), a word-level RNN LM with hand-written SGD updates, a float64 LSTM trained by
L-BFGS with a closure, a CSV time-series forecaster (Dataset + DataLoader), and a two-network BCE
GAN; and (third round) a house-price MLP whose forward checks its own hidden state, a TCN over
CSV windows built from Python lists, a BatchNorm churn classifier, a semi-supervised loop with
few labels, a float16 bag-of-words model under Adam and a hand-written pairwise ranking loss.

Each program has a healthy configuration (no alarm: status `healthy`, exit 0) and a failing one,
broken through a flag, a data file or a checkpoint. The expected finding of every failing case is
established without nanguard: the step and phase come from the same script run under a small
plain-PyTorch tracer (`scripts/_nantrace.py`, switched on by `NANTRACE=1`), and the cause from how
the run was broken. nanguard must report `failed` with that step, phase and top cause, exit 1
from `nanguard run` and non-zero from `nanguard report`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from programs_support import (
    Guarded,
    both,
    guarded,
    plain,
    report_exit,
    write_load_csv,
    write_points_csv,
)


def assert_healthy(cwd: Path, name: str, *args: str,
                   prepare: Callable[[Path], object] | None = None,
                   check_report: bool = False) -> None:
    """The tracer sees nothing non-finite, and nanguard calls the run healthy without alarms
    (`warned` would be a false alarm) after watching every step the tracer counted, exit 0;
    with `check_report`, `nanguard report` exits 0 too (one more process start, so only where
    asked)."""
    traced, g = both(cwd, name, *args, prepare=prepare)
    assert traced.first is None, f"the healthy configuration is not healthy: {traced}"
    got = {"exit": g.proc.returncode, "status": g.report["status"], "steps": g.report["steps"],
           "alarms": g.report["alarms"], "first_nonfinite": g.report["first_nonfinite"]}
    want = {"exit": 0, "status": "healthy", "steps": traced.steps, "alarms": [],
            "first_nonfinite": None}
    if check_report:
        got["report_exit"], want["report_exit"] = report_exit(g.out), 0
    assert got == want, g.explain()


def assert_failed(g: Guarded, expected: dict[str, Any], exit_code: int = 1) -> None:
    """nanguard's finding against the independently established one (all fields compared at
    once, so a failure shows every mismatch)."""
    first = g.report.get("first_nonfinite") or {}
    got: dict[str, Any] = {
        "status": g.report["status"], "exit": g.proc.returncode,
        "report_exit_nonzero": report_exit(g.out) != 0,
        "step": first.get("step"), "phase": first.get("phase"),
        "cause": g.causes[0] if g.causes else None,
    }
    want: dict[str, Any] = {"status": "failed", "exit": exit_code, "report_exit_nonzero": True,
                            **expected}
    for key in ("samples",):
        if key in expected:
            got[key] = first.get(key)
    assert got == want, g.explain()


# ----------------------------------------------------------------------------------- GPT

GPT = "gpt_train.py"
GPT_ARGS = ("--max-iters", "30", "--eval-interval", "15", "--lr-decay-iters", "30")


def test_gpt_healthy(tmp_path: Path) -> None:
    """nanoGPT-style run with warm-up + cosine, clipping, eval passes under no_grad, checkpoint
    saves: healthy, no alarm."""
    assert_healthy(tmp_path, GPT, *GPT_ARGS, check_report=True)


def test_gpt_lr_typo_diverges(tmp_path: Path) -> None:
    """`--lr 1e3` (meant 1e-3): AdamW's decoupled decay (x(1 - lr*wd) = x-99 per step) makes the
    weights grow geometrically until a LayerNorm's variance overflows in the forward."""
    traced, g = both(tmp_path, GPT, *GPT_ARGS, "--lr", "1e3")
    expected = traced.first
    assert expected is not None and expected["phase"] == "forward", expected
    assert_failed(g, {"step": expected["step"], "phase": "forward",
                      "cause": "optimizer_divergence"})
    # The fix must be one: the script itself, run with the LR the fix proposes (warm-up and
    # cosine still scaling it), trains without a non-finite value and lowers its loss.
    # It is read as the typo it is, in the script's own flag.
    fix = g.report["diagnosis"][0]["fix"]
    found = re.search(r"did you mean `--lr ([0-9.e+-]+)`\? `--lr 1e3` is 1e6x AdamW's", fix)
    assert found is not None and found.group(1) == "1e-3", fix
    fixed = plain(tmp_path, GPT, *GPT_ARGS, "--lr", found.group(1))
    losses = [float(m) for m in re.findall(r"^iter \d+: loss (\S+),", fixed.stdout, re.M)]
    assert fixed.returncode == 0 and len(losses) >= 3, fixed.stderr[-2000:]
    # (1e-3 is the script's own default: 5.54 -> 4.64 in its 40 iterations, seed 0)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.9 * losses[0], losses


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint: 6 training steps of the script itself, saved by it at iter 6."""
    d = tmp_path_factory.mktemp("gpt_ckpt")
    r = plain(d, GPT, "--out-dir", "ckpt", "--always-save-checkpoint", "--max-iters", "6",
              "--eval-interval", "6")
    assert r.returncode == 0, r.stderr
    assert (d / "ckpt" / "ckpt.pt").is_file()
    return d / "ckpt" / "ckpt.pt"


def _resume_dir(folder: Path, ckpt: Path, poison: str | None) -> None:
    state = torch.load(ckpt, map_location="cpu")
    if poison == "exp_avg_sq":
        # Adam's second moment of one matrix (the first MLP weight of block 1).
        names = [n for n, p in _gpt_param_order(state["model"])]
        index = names.index("transformer.h.1.mlp.c_fc.weight")
        state["optimizer"]["state"][index]["exp_avg_sq"][0, 0] = float("nan")
    elif poison == "weight":
        state["model"]["transformer.h.1.mlp.c_fc.weight"][0, 0] = float("nan")
    (folder / "ckpt").mkdir()
    torch.save(state, folder / "ckpt" / "ckpt.pt")


def _gpt_param_order(model_state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameter order in gpt_train.py: matrices (decayed) then the rest, each
    in `named_parameters()` order (the tied `lm_head.weight` is `transformer.wte.weight`)."""
    named = [(n, t) for n, t in model_state.items()
             if not n.endswith(".attn.bias") and n != "lm_head.weight"]
    return [x for x in named if x[1].dim() >= 2] + [x for x in named if x[1].dim() < 2]


RESUME_ARGS = ("--init-from", "resume", "--out-dir", "ckpt", "--max-iters", "14",
               "--eval-interval", "7")


def test_gpt_resume_healthy(tmp_path: Path, gpt_checkpoint: Path) -> None:
    """Resuming model + AdamW state from a clean checkpoint is healthy (the loaded optimizer
    state is not an alarm)."""
    assert_healthy(tmp_path, GPT, *RESUME_ARGS,
                   prepare=lambda d: _resume_dir(d, gpt_checkpoint, None))


@pytest.mark.parametrize("poison", ["exp_avg_sq", "weight"])
def test_gpt_resume_poisoned_checkpoint(tmp_path: Path, gpt_checkpoint: Path,
                                        poison: str) -> None:
    """`--init-from resume` on a checkpoint with one NaN in an Adam `exp_avg_sq` (or in a
    weight): the value was non-finite before the first step of this process, it came from the
    checkpoint, not from the data or the step: phase `checkpoint`, cause
    `checkpoint_nonfinite`, step 0."""
    traced, g = both(tmp_path, GPT, *RESUME_ARGS,
                       prepare=lambda d: _resume_dir(d, gpt_checkpoint, poison))
    expected = traced.first
    assert expected is not None and (expected["step"], expected["phase"]) == (0, "checkpoint")
    assert_failed(g, {"step": 0, "phase": "checkpoint", "cause": "checkpoint_nonfinite"})
    # The line that loaded the poisoned tensor itself: the weights come from the model's
    # `load_state_dict`, the Adam moment from the optimizer's (the script's own lines, found
    # by their text: an independent check).
    call = "model.load_state_dict(" if poison == "weight" else "optimizer.load_state_dict("
    lines = (Path(__file__).parent / "scripts" / GPT).read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if call in text)
    assert g.first["source"] == f"{Path(__file__).parent / 'scripts' / GPT}:{line}", g.explain()
    assert f"{GPT}:{line}" in g.report["diagnosis"][0]["evidence"], g.explain()
    # Said while it ran, not only at the end: the live line names the load and its line.
    assert (f"first non-finite value at step 0: phase checkpoint in "
            f"'transformer.h.1.mlp.c_fc' at {g.first['source']}") in g.proc.stderr, g.explain()


def test_gpt_resume_from_a_checkpoint_that_changed_after_its_save(
        tmp_path: Path, gpt_checkpoint: Path) -> None:
    """The script's checkpoint saved with its manifest (`nanguard.save`), then one mantissa bit
    of one weight flipped in the file: it loads without error and every value stays finite, so
    only the manifest can tell. `nanguard run` says so while the script runs (an ERROR line
    naming the tensor) and the report is never `healthy`: a `checkpoint_mismatch` alarm and the
    cause `checkpoint_corrupt`, naming exactly the tensor that differs (found independently by
    comparing the file with what was saved)."""
    import nanguard

    name = "transformer.h.1.mlp.c_fc.weight"
    state = torch.load(gpt_checkpoint, map_location="cpu")
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "ckpt" / "ckpt.pt"
    nanguard.save(state, path)
    flipped = torch.load(path, map_location="cpu")
    flipped["model"][name].view(torch.int32)[3, 5] ^= 1 << 4  # a low mantissa bit
    torch.save(flipped, path)  # as a corrupting copy would leave it: the manifest is the old one
    differ = [k for k, v in flipped["model"].items() if not v.equal(state["model"][k])]
    assert differ == [name] and torch.isfinite(flipped["model"][name]).all()

    g = guarded(tmp_path, GPT, *RESUME_ARGS)
    assert g.proc.returncode == 0, g.explain()
    assert f"differs from its manifest in 1 tensor(s): model.{name}" in g.proc.stderr
    # Said once, at load time (the step-0 alarm records it without a second live line).
    live = g.proc.stderr.split("warned after")[0]  # the lines before the closing summary
    assert live.count("differs from its manifest") == 1, g.proc.stderr[-2000:]
    assert g.report["status"] == "warned", g.explain()
    [alarm] = [a for a in g.report["alarms"] if a["kind"] == "checkpoint_mismatch"]
    assert alarm["step"] == 0 and f"model.{name}" in alarm["message"]
    assert g.causes[0] == "checkpoint_corrupt" and f"model.{name}" in \
        g.report["diagnosis"][0]["evidence"], g.explain()


# ---------------------------------------------------------------------------------- RNN LM

RNN = "rnn_lm.py"
RNN_ARGS = ("--model", "RNN_RELU", "--max-iters", "60")


def test_rnn_lm_healthy(tmp_path: Path) -> None:
    """ReLU RNN LM, hand-written SGD (lr 20) with manual clipping at 0.25: healthy. There is no
    torch.optim optimizer: the step boundary is the backward."""
    assert_healthy(tmp_path, RNN, *RNN_ARGS)


def test_rnn_lm_no_clip_diverges(tmp_path: Path) -> None:
    """`--clip 0`: the same run without clipping; the SGD updates blow the recurrent weights up
    and the RNN's activations overflow in the forward a few batches in."""
    traced, g = both(tmp_path, RNN, *RNN_ARGS, "--clip", "0")
    expected = traced.first
    assert expected is not None and expected["phase"] == "forward", expected
    assert_failed(g, {"step": expected["step"], "phase": "forward",
                      "cause": "optimizer_divergence"})


# ------------------------------------------------------------------------------ L-BFGS f64

LBFGS = "lbfgs_seq.py"
LBFGS_ARGS = ("--max-iters", "8")


def test_lbfgs_float64_healthy(tmp_path: Path) -> None:
    """float64 LSTM, L-BFGS with a closure (several forward/backward per step), mini-batches
    from a DataLoader, dead all-zero traces standardized with eps 1e-5: healthy."""
    assert_healthy(tmp_path, LBFGS, *LBFGS_ARGS)


def test_lbfgs_float64_eps0_division_by_zero(tmp_path: Path) -> None:
    """`--eps 0`: the batch holding a dead (all-zero) trace divides 0 by sqrt(0) in the
    model's standardization: NaN first made in the forward, cause division_by_zero."""
    traced, g = both(tmp_path, LBFGS, *LBFGS_ARGS, "--eps", "0")
    # Dead trace 29 is in batch 29 // 8 = 3 (no shuffling): an independent check of the step.
    expected = traced.first
    assert expected is not None and (expected["step"], expected["phase"]) == (3, "forward")
    assert_failed(g, {"step": 3, "phase": "forward", "cause": "division_by_zero"})


def test_lbfgs_gap_from_the_first_closure_call_raise(tmp_path: Path) -> None:
    """`--gap 3 10`: one lost reading (NaN) in trace 3, which is in the first batch (no
    shuffling): the first closure call of the first step already meets it, and `raise` stops
    the run there. nanguard's own epilogue must not fail after that (it once wrote the settled
    finding into the store the `raise` had closed): no traceback, a report.json, phase `data`,
    the culprit sample, cause `data_nonfinite`."""
    traced, g = both(tmp_path, LBFGS, *LBFGS_ARGS, "--gap", "3", "10",
                     options=("--policy", "raise"))
    assert traced.first == {"step": 0, "phase": "data", "samples": [3]}, traced
    assert "Traceback" not in g.proc.stderr, g.explain()
    assert_failed(g, {"step": 0, "phase": "data", "cause": "data_nonfinite", "samples": [3]})


# ------------------------------------------------------------------------- CSV forecaster

CSV = "csv_forecaster.py"
NAN_ROW = 444


def test_csv_forecaster_healthy(tmp_path: Path) -> None:
    """GRU forecaster over sliding windows of a clean CSV, shuffled DataLoader, Adam: healthy."""
    assert_healthy(tmp_path, CSV, "--csv", "load.csv",
                   prepare=lambda d: write_load_csv(d / "load.csv"))


def _windows_with_row(row: int, window: int = 8, batch: int = 16, rows: int = 600,
                      val_frac: float = 0.1, seed: int = 0) -> tuple[int, list[int]]:
    """Recomputed from the DataLoader's contract: the first batch (shuffled by a generator
    seeded with `seed`, as the script does) holding a window that covers `row`, and the
    positions of those windows in it."""
    n_train = rows - int(rows * val_frac) - window
    g = torch.Generator().manual_seed(seed)
    # A DataLoader iterator draws its base seed from the loader's generator first, then the
    # RandomSampler draws its permutation from the same generator.
    torch.empty((), dtype=torch.int64).random_(generator=g)
    perm = torch.randperm(n_train, generator=g).tolist()
    for b in range(n_train // batch):
        idx = perm[b * batch:(b + 1) * batch]
        hits = [k for k, i in enumerate(idx) if i <= row < i + window]
        if hits:
            return b, hits
    raise AssertionError("row not in any training window")


def test_csv_forecaster_nan_cell(tmp_path: Path) -> None:
    """One empty humidity cell (row 444): the first shuffled batch whose windows cover it has
    NaN inputs: phase `data`, cause `data_nonfinite`, the culprit samples named."""
    traced, g = both(tmp_path, CSV, "--csv", "load.csv",
                       prepare=lambda d: write_load_csv(d / "load.csv", nan_row=NAN_ROW))
    step, samples = _windows_with_row(NAN_ROW)
    assert traced.first == {"step": step, "phase": "data", "samples": samples}
    assert_failed(g, {"step": step, "phase": "data", "cause": "data_nonfinite",
                      "samples": samples})


# ---------------------------------------------------------------------------------- GAN

GAN = "gan_bce.py"


def test_gan_bce_healthy(tmp_path: Path) -> None:
    """Generator + sigmoid discriminator, BCELoss, two Adam optimizers, real points from a CSV
    through a shuffled DataLoader: healthy, no alarm on either optimizer."""
    assert_healthy(tmp_path, GAN, "--data", "points.csv",
                   prepare=lambda d: write_points_csv(d / "points.csv"))


def test_gan_bce_nan_point_kills_the_script(tmp_path: Path) -> None:
    """One real point with x = nan: the discriminator's output is NaN and BCELoss raises
    (`all elements of input should be between 0 and 1`) before any backward of that step. The
    script died after a non-finite value reached the model: `failed`, never `healthy`; the
    finding is the discriminator's step holding the point, phase `data`, the culprit sample."""
    traced, g = both(tmp_path, GAN, "--data", "points.csv",
                       prepare=lambda d: write_points_csv(d / "points.csv", nan_row=700))
    expected = traced.first
    assert expected is not None and expected["phase"] == "data", expected
    assert "all elements of input should be between 0 and 1" in g.proc.stderr
    assert_failed(g, {"step": expected["step"], "phase": "data", "cause": "data_nonfinite",
                      "samples": expected["samples"]})


# ------------------------------------------------------------------ CNN, DataLoader workers

CNN = "cnn_workers.py"


def test_cnn_workers_bf16_accumulation_healthy(tmp_path: Path) -> None:
    """BatchNorm CNN, DataLoader with two worker processes, bf16 autocast, accumulation over
    two micro-batches, AdamW + cosine, clipping, eval and checkpoints: healthy, no alarm."""
    assert_healthy(tmp_path, CNN, "--bf16")


def test_cnn_workers_nan_pixel(tmp_path: Path) -> None:
    """One NaN pixel in image 100; the batches come from worker processes (through shared
    memory: no op of the training process computes the value). The update step and the
    sample are recomputed from the DataLoader's contract (the same loader over indices:
    workers do not change the order); samples are numbered across the step's two
    micro-batches. Phase `data`, cause `data_nonfinite`, the culprit sample named."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import cnn_workers

    order = [int(i) for b in cnn_workers.loader(range(512), 0) for i in b]
    pos = order.index(100)
    batch, row = divmod(pos, cnn_workers.BATCH)
    step, micro = divmod(batch, 2)
    traced, g = both(tmp_path, CNN, "--nan-index", "100")
    assert traced.first is not None and (traced.first["step"], traced.first["phase"]) == (
        step, "data"), traced.first
    assert_failed(g, {"step": step, "phase": "data", "cause": "data_nonfinite",
                      "samples": [micro * cnn_workers.BATCH + row]})
    # The op that adopted the worker's memory is no culprit: the summary says how it arrived.
    # (Which op the checker sees first is a race: a batch the workers delivered before the
    # re-run armed it shows at the first op that reads it, the convolution.)
    said = " ".join((g.proc.stderr + g.proc.stdout).split())
    if g.first["op"] == "aten.set_":
        assert "op aten.set_: it arrived with a DataLoader worker's batch" in said, said[-2000:]
    # The script is seeded and runs on the CPU: its re-run repeats the step bit for bit (the
    # tracer's own run, above, failed at the same step). Its loss is divided by --accum for
    # the backward and recorded undivided: compared in those units, no `nondeterministic`.
    assert g.first.get("reproduced") is True and "nondeterministic" not in g.causes, g.explain()
    # BatchNorm's running statistics took the NaN in the same forward: an alarm at the NaN's
    # own step, no warning before it.
    assert any(a["step"] == step and a["kind"] == "buffer_nonfinite"
               for a in g.report["alarms"]), g.explain()
    assert g.report["first_warning"] is None and g.report["lead_steps"] is None, g.explain()
    assert "0 steps before" not in said and (
        f"no warning came before it: buffer_nonfinite came at its own step {step}") in said


# --------------------------------------------------------------------- house prices (MLP)

HOUSES = "house_prices.py"


def _house_batch(listing: int) -> tuple[int, int]:
    """(update step, row in its batch) of `listing`, recomputed from the DataLoader's contract
    (the script's own `loader` over the listing indices: the same generator, the same
    order)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import house_prices

    ids = torch.arange(house_prices.N_LISTINGS, dtype=torch.float32).unsqueeze(1)
    order = [int(i) for x, _ in house_prices.loader(ids, torch.zeros_like(ids), 0)
             for i in x.flatten()]
    return divmod(order.index(listing), house_prices.BATCH)


def test_house_prices_healthy(tmp_path: Path) -> None:
    """Log-transformed features inside the forward, a NaN check of its own, AdamW + cosine:
    healthy, no alarm."""
    assert_healthy(tmp_path, HOUSES)


def test_house_prices_zero_area_own_nan_check(tmp_path: Path) -> None:
    """Listing 300 has area 0: `log(area)` is -inf in the forward of the batch holding it and
    the script's own check raises `FloatingPointError` inside `forward`, before any loss. The
    user's exception reaches them as it is (no nanguard error, no `degraded`), and what was
    non-finite before it is the finding: `failed`, that step, phase `forward`, the culprit
    sample, cause `log_of_nonpositive`, the `log` line; the exit code is the script's."""
    step, row = _house_batch(300)
    traced, g = both(tmp_path, HOUSES, "--zero-area", "300")
    assert traced.first is not None
    assert (traced.first["step"], traced.first["phase"]) == (step, "forward"), traced.first
    assert "FloatingPointError: PriceNet: non-finite hidden state" in g.proc.stderr
    assert "internal error" not in g.proc.stderr, g.explain()
    assert_failed(g, {"step": step, "phase": "forward", "cause": "log_of_nonpositive",
                      "samples": [row]})
    assert (g.first["op"], g.first["source"].rsplit(":", 1)[0]) == (
        "aten.log", str(Path(__file__).parent / "scripts" / HOUSES)), g.explain()


def test_house_prices_without_a_rerun_is_undetermined_not_causeless(tmp_path: Path) -> None:
    """The same failure with the re-run turned off (`--replay-budget 0`): no op-level origin,
    so no cause can be shown; the diagnosis still is not empty: an `undetermined` entry says
    the op is missing, why (the re-run was off) and how to get it."""
    g = guarded(tmp_path, HOUSES, "--zero-area", "300", options=("--replay-budget", "0"))
    step, _ = _house_batch(300)
    assert (g.report["status"], g.first["step"], g.first["phase"]) == (
        "failed", step, "forward"), g.explain()
    assert g.causes == ["undetermined"], g.explain()
    entry = g.report["diagnosis"][0]
    assert "no op-level origin" in entry["evidence"], entry
    assert "--replay-budget 0" in entry["evidence"], entry
    assert "nanguard run --policy raise" in entry["fix"], entry


def test_house_prices_weight_decay_typo_blames_the_decay(tmp_path: Path) -> None:
    """`--weight-decay 1e4` (meant 1e-4) at the ordinary lr 3e-3: AdamW multiplies every weight
    by 1 - lr * wd = -29 each step. The fix must name the weight decay with the run's numbers,
    not lower an LR that is fine; and it must be one: the script run with the proposed decay
    trains without a non-finite value."""
    traced, g = both(tmp_path, HOUSES, "--weight-decay", "1e4")
    expected = traced.first
    assert expected is not None
    assert_failed(g, {"step": expected["step"], "phase": expected["phase"],
                      "cause": "optimizer_divergence"})
    fix = g.report["diagnosis"][0]["fix"]
    found = re.search(r"`--weight-decay 1e4` -> `--weight-decay ([0-9.e+-]+)`", fix)
    assert found is not None and "lower the LR" not in fix, fix
    fixed = plain(tmp_path, HOUSES, "--weight-decay", found.group(1))
    mse = [float(m) for m in re.findall(r"^epoch \d+: mse (\S+)$", fixed.stdout, re.M)]
    assert fixed.returncode == 0 and len(mse) == 2, fixed.stderr[-2000:]
    assert all(math.isfinite(v) for v in mse) and mse[-1] < mse[0], mse


def test_house_prices_shape_error_is_the_scripts_own(tmp_path: Path) -> None:
    """From step 5 on the batches carry one more column: a shape error inside `forward`,
    nothing non-finite anywhere. The run is `crashed` (the script's own error), watched up
    to step 5, with the script's exception and exit code; never `degraded`, never `failed`."""
    traced, g = both(tmp_path, HOUSES, "--extra-column-at", "5")
    assert (traced.first, traced.steps) == (None, 5)
    assert "RuntimeError: The size of tensor a (5) must match" in g.proc.stderr
    got = {"exit": g.proc.returncode, "status": g.report["status"], "steps": g.report["steps"],
           "first_nonfinite": g.report["first_nonfinite"],
           "internal": "internal error" in g.proc.stderr}
    assert got == {"exit": 1, "status": "crashed", "steps": 5, "first_nonfinite": None,
                   "internal": False}, g.explain()


# ------------------------------------------------------------------ station TCN (CSV, lists)

TCN = "station_tcn.py"


def _tcn_batch(gap: range, window: int = 12, horizon: int = 3, batch: int = 16,
               rows: int = 600) -> tuple[int, list[int]]:
    """(update step, rows of its batch) of the first batch holding a window that covers a row
    of `gap`, recomputed from the DataLoader's contract (the script's own `loader` over the
    window indices)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import station_tcn

    n = rows - window - horizon + 1
    ids = torch.utils.data.TensorDataset(torch.arange(n))
    for step, (idx,) in enumerate(station_tcn.loader(ids, batch, 0)):
        hits = [k for k, i in enumerate(idx.tolist()) if any(i <= r < i + window for r in gap)]
        if hits:
            return step, hits
    raise AssertionError("the gap is in no training window")


def test_station_tcn_healthy(tmp_path: Path) -> None:
    """Windows built by `torch.tensor(rows[...])` in the Dataset, `.to().float()` in the loop,
    dilated causal convolutions, Huber loss: healthy, no alarm."""
    assert_healthy(tmp_path, TCN, "--csv", "load.csv",
                   prepare=lambda d: write_load_csv(d / "load.csv"))


@pytest.mark.parametrize("start", [250, 40])
def test_station_tcn_gap_is_data(tmp_path: Path, start: int) -> None:
    """Three consecutive empty humidity readings. No op computes the NaN: it is read into the
    window by `torch.tensor`, assembled by the collate's `stack`, cast by `.float()`; those
    ops load the batch (phase `data`, not `loss`), and the batch rows holding it are the
    evidence of `data_nonfinite`. Step and rows recomputed from the loader's order."""
    step, samples = _tcn_batch(range(start, start + 3))
    traced, g = both(tmp_path, TCN, "--csv", "load.csv",
                     prepare=lambda d: write_load_csv(d / "load.csv", nan_row=start, gap=3),
                     options=("--policy", "raise"))
    assert traced.first == {"step": step, "phase": "data", "samples": samples}, traced
    assert_failed(g, {"step": step, "phase": "data", "cause": "data_nonfinite",
                      "samples": samples})
    assert g.first["op"] == "aten.stack", g.explain()


# ------------------------------------------------------------------ churn (BatchNorm input)

CHURN = "churn_bn.py"


def _churn_batch(customer: int) -> tuple[int, int]:
    """(update step, row in its batch) of `customer`, from the loader's own order."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import churn_bn

    ids = torch.arange(churn_bn.N_CUSTOMERS, dtype=torch.float32).unsqueeze(1)
    order = [int(i) for x, _ in churn_bn.loader(ids, torch.zeros_like(ids), 0)
             for i in x.flatten()]
    return divmod(order.index(customer), churn_bn.BATCH)


def test_churn_bn_healthy(tmp_path: Path) -> None:
    """BatchNorm input layer, BCE with logits, Adam, eval passes: healthy, no alarm."""
    assert_healthy(tmp_path, CHURN)


def test_churn_bn_missing_income_in_the_first_batch_is_data_not_a_checkpoint(
        tmp_path: Path) -> None:
    """Customer 255 (in the first shuffled batch) has no income: BatchNorm writes NaN into its
    running statistics in that forward, before the first update, so the state is non-finite
    when the first step starts, but nothing was loaded: never `checkpoint_nonfinite` (that
    cause needs a load), the batch row is the finding (`data`, `data_nonfinite`)."""
    step, row = _churn_batch(255)
    assert step == 0
    traced, g = both(tmp_path, CHURN, "--missing-income", "255")
    assert traced.first == {"step": 0, "phase": "data", "samples": [row]}, traced
    assert "checkpoint_nonfinite" not in g.causes, g.explain()
    assert_failed(g, {"step": 0, "phase": "data", "cause": "data_nonfinite",
                      "samples": [row]})


# -------------------------------------------------------------- semi-supervised (few labels)

SEMI = "semi_supervised.py"


def _first_unlabelled_batch(labelled: int, epochs: int = 2) -> int:
    """The first update step whose batch holds no labelled point, from the script's own data
    and loaders (one per epoch, seeded `seed + epoch`)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import semi_supervised as semi

    x, y = semi.make_moons(semi.N_POINTS, labelled, 0)
    step = 0
    for epoch in range(epochs):
        for _, yb in semi.loader(x, y, epoch):
            if not bool((yb >= 0).any()):
                return step
            step += 1
    raise AssertionError("every batch holds a labelled point")


def test_semi_supervised_healthy(tmp_path: Path) -> None:
    """Half the points labelled: every batch has labelled points; healthy, no alarm."""
    assert_healthy(tmp_path, SEMI)


def test_semi_supervised_batch_without_labels_is_an_empty_mean(tmp_path: Path) -> None:
    """48 labels of 512 points: batch 4 holds none, its cross-entropy over the empty labelled
    selection is 0 / 0. The origin op's input has 0 rows: `division_by_zero` (an empty
    reduction), never an empty diagnosis; phase `loss` at that step."""
    step = _first_unlabelled_batch(48)
    assert step == 4
    traced, g = both(tmp_path, SEMI, "--labelled", "48")
    assert traced.first == {"step": step, "phase": "loss"}, traced
    assert_failed(g, {"step": step, "phase": "loss", "cause": "division_by_zero"})
    assert "empty" in g.report["diagnosis"][0]["evidence"], g.explain()


# ------------------------------------------------------------ fixes that fit the run's numbers

HALF = "half_bow.py"
RANK = "pairwise_rank.py"


def test_half_bow_healthy(tmp_path: Path) -> None:
    """EmbeddingBag + linear head in float32, Adam: healthy, no alarm."""
    assert_healthy(tmp_path, HALF)


def test_half_bow_float16_parameters_round_adam_eps_to_zero(tmp_path: Path) -> None:
    """`--half`: the model's parameters in float16, Adam's eps the default 1e-8, which is 0 in
    float16: words absent from the first batch get 0 / 0 in the first update. The fix must not
    propose the eps the run already has (1e-8); it names float16 and an eps float16 holds."""
    traced, g = both(tmp_path, HALF, "--half")
    assert traced.first is not None
    assert (traced.first["step"], traced.first["phase"]) == (0, "optimizer"), traced.first
    assert_failed(g, {"step": 0, "phase": "optimizer", "cause": "optimizer_state_nonfinite"})
    entry = g.report["diagnosis"][0]
    assert "0 in float16" in entry["evidence"], entry
    assert "eps=1e-8)" not in entry["fix"] and "float16" in entry["fix"], entry


def test_pairwise_rank_healthy(tmp_path: Path) -> None:
    """RankNet-style loss written by hand on standardized features: healthy, no alarm."""
    assert_healthy(tmp_path, RANK)


def test_pairwise_rank_raw_features_overflow_a_handwritten_softplus(tmp_path: Path) -> None:
    """`--no-standardize`: raw prices make score differences of ~1e5; `exp(-(s_i - s_j))` in
    the hand-written `log(1 + exp(...))` overflows in the loss at step 0. The fix is
    `F.softplus` (there is no max to subtract: a softmax / logsumexp fix does not apply)."""
    traced, g = both(tmp_path, RANK, "--no-standardize")
    assert traced.first == {"step": 0, "phase": "loss"}, traced
    assert_failed(g, {"step": 0, "phase": "loss", "cause": "exp_overflow"})
    fix = g.report["diagnosis"][0]["fix"]
    assert "F.softplus" in fix and "logsumexp" not in fix, fix
    assert g.first["op"] == "aten.exp", g.explain()
