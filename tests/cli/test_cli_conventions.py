"""What every subcommand shares: exit codes at the end of its --help, one JSON flag (`--json`;
`--format json` still works and says it is deprecated), no torch import for `--help`,
`--version` and `lint`, a user's mistake as one line with exit 2 and nanguard's own error as a
bug with the file its traceback went to (exit 3); `nanguard demo` run twice into one folder;
`audit` and `scan` of a folder (a sharded Hugging Face checkpoint, a data set in shards), per
file and in total."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanguard.cli.main import COMMANDS, EXIT_INTERNAL, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "COLUMNS": "160"}


def _nanguard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nanguard", *args], capture_output=True,
                          text=True, timeout=300, env=ENV, cwd=cwd)


def _subparsers() -> dict[str, object]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return dict(action.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_help_ends_with_the_exit_codes(name: str) -> None:
    text = _subparsers()[name].format_help()  # type: ignore[attr-defined]
    codes = text[text.index("exit codes:"):]
    for code in ("0", "1", "2", str(EXIT_INTERNAL)):
        assert f"\n  {code}  " in codes, text


def test_top_level_help_has_the_exit_codes() -> None:
    assert "exit codes:" in build_parser().format_help()


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["lint", "--list-rules"],
                                  ["lint", "LINTED"], ["audit", "--help"], ["demo", "--help"]])
def test_no_torch_import(argv: list[str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.log(torch.rand(3))\n")
    argv = [str(script) if a == "LINTED" else a for a in argv]
    code = (
        "import sys\nfrom nanguard.cli.main import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert "TORCH False" in proc.stderr, proc.stderr


def test_the_start_path_imports_only_what_it_uses() -> None:
    """Every `nanguard` start builds every subcommand's parser, and `nanguard run` imports the
    live preflight: neither imports what another command uses when it runs (the auditors and
    numpy, the dashboard's http.server, rich): `nanguard --version` took 0.23 s of CPU with
    them, 0.07 s without."""
    code = (
        "import sys\nfrom nanguard.cli.main import build_parser\nbuild_parser()\n"
        "print('PARSER', sorted(m for m in sys.modules if m.startswith('nanguard.audit')\n"
        "      or m.split('.')[0] in ('numpy', 'rich', 'http', 'torch')))\n"
        "import nanguard.audit.preflight_live\n"
        "print('LIVE', sorted(m for m in sys.modules if m.startswith('nanguard.audit.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "PARSER []" in proc.stdout, proc.stdout
    assert ("LIVE ['nanguard.audit.common', 'nanguard.audit.preflight', "
            "'nanguard.audit.preflight_live']") in proc.stdout, proc.stdout


def test_json_flag_and_the_deprecated_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.log(torch.rand(3))\n")
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(3)}, ckpt)
    for argv in (["lint", str(script)], ["audit", str(ckpt)]):
        main([*argv, "--json"])
        captured = capsys.readouterr()
        new = json.loads(captured.out)
        assert "deprecated" not in captured.err
        main([*argv, "--format", "json"])
        captured = capsys.readouterr()
        assert json.loads(captured.out) == new
        assert "--format json is deprecated; use --json" in captured.err
    for name in ("audit", "scan", "lint", "report", "replay", "demo"):
        text = _subparsers()[name].format_help()  # type: ignore[attr-defined]
        assert "--json" in text and "--format" not in text, name


def test_user_error_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = _nanguard("audit", str(tmp_path / "missing.pt"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_internal_error_is_called_a_bug_with_its_traceback_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import nanguard.audit.checkpoint as checkpoint

    def broken(path: str, **_: object) -> None:
        return {}["no such key"]  # type: ignore[return-value]

    monkeypatch.setattr(checkpoint, "audit_checkpoint", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(3)}, ckpt)
    assert main(["audit", str(ckpt)]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "internal error (a bug in nanguard, not a mistake in your input): KeyError" in err
    (written,) = tmp_path.glob("nanguard-error-audit-*.txt")
    assert str(written) in err and len(err.strip().splitlines()) == 1
    text = written.read_text()
    assert "Traceback" in text and "broken" in text and "nanguard audit" in text


def test_value_error_from_a_library_is_a_bug(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    """A ValueError that no `raise` of nanguard's raised (here: a builtin's) is not the user's."""
    import nanguard.audit.lint as lint

    def broken(*args: object, **kwargs: object) -> None:
        int("not a number")

    monkeypatch.setattr(lint, "lint_paths", broken)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["lint", str(tmp_path)]) == EXIT_INTERNAL
    assert "ValueError" in capsys.readouterr().err


def test_demo_twice_into_one_folder(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    for _ in range(2):
        proc = _nanguard("demo", "--seeds", "1", "--steps", "40", "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        assert "RecordConfig" not in proc.stderr
    proc = _nanguard("demo", "--seeds", "1", "--steps", "40", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    (seed,) = json.loads(proc.stdout)
    assert seed["seed"] == 0 and seed["folder"] == str(out / "seed-0")
    assert seed["status"] == json.loads((out / "seed-0" / "report.json").read_text())["status"]


def _hf_checkpoint(folder: Path) -> None:
    """A Trainer-style checkpoint-N/: two safetensors shards and their index (a NaN in the
    second), two of three .bin shards of an older save with their index, and the files that
    are no tensor checkpoint (training_args.bin, rng_state.pth)."""
    from safetensors.torch import save_file

    folder.mkdir()
    w = {"embed.weight": torch.randn(10, 4), "layer.weight": torch.randn(4, 4)}
    w["layer.weight"][1, 2] = float("nan")
    save_file({"embed.weight": w["embed.weight"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"layer.weight": w["layer.weight"]}, folder / "model-00002-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "embed.weight": "model-00001-of-00002.safetensors",
        "layer.weight": "model-00002-of-00002.safetensors"}}))
    torch.save({"embed.weight": torch.ones(2)}, folder / "pytorch_model-00001-of-00003.bin")
    torch.save({"head.weight": torch.ones(2)}, folder / "pytorch_model-00002-of-00003.bin")
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
        "embed.weight": "pytorch_model-00001-of-00003.bin",
        "head.weight": "pytorch_model-00002-of-00003.bin",
        "other.weight": "pytorch_model-00002-of-00003.bin",
        "last.weight": "pytorch_model-00003-of-00003.bin"}}))
    torch.save({"python": [1, 2], "numpy": torch.ones(1).numpy()}, folder / "rng_state.pth")
    (folder / "training_args.bin").write_bytes(b"\x80\x04not a tensor file")


def test_audit_a_sharded_checkpoint_folder(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("safetensors")
    folder = tmp_path / "checkpoint-500"
    _hf_checkpoint(folder)
    assert main(["audit", str(folder), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["file"] for f in report["files"]] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "pytorch_model-00001-of-00003.bin", "pytorch_model-00002-of-00003.bin"]
    assert {s["file"] for s in report["skipped"]} == {"rng_state.pth", "training_args.bin"}
    codes = {(f["code"], f["location"]) for f in report["findings"]}
    assert ("missing_shard", "pytorch_model-00003-of-00003.bin") in codes
    assert ("missing_tensor", "pytorch_model-00002-of-00003.bin") in codes
    nan_file = report["files"][1]
    assert [f["code"] for f in nan_file["findings"]] == ["nonfinite"]
    assert report["total"]["files"] == 4 and report["total"]["tensors"] == 4
    assert report["total"]["nonfinite_values"] == 1
    assert report["total"]["errors"] == 3

    assert main(["audit", str(folder)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "model-00002-of-00002.safetensors" in out and "skipped" in out
    assert "total: 4 files, 2 skipped, 4 tensors" in out and "3 problem(s) found" in out


def test_audit_a_clean_folder_and_errors(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ok"
    folder.mkdir()
    torch.save({"w": torch.ones(3)}, folder / "a.pt")
    torch.save({"w": torch.ones(3)}, folder / "b.pt")
    assert main(["audit", str(folder)]) == 0
    assert "no problems found" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["audit", str(empty)]) == 2
    assert "no checkpoint files" in capsys.readouterr().err
    assert main(["audit", str(folder), str(folder / "a.pt")]) == 2


def test_scan_a_folder_of_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    (folder / "more").mkdir(parents=True)
    (folder / "part-0.csv").write_text("a,b\n" + "\n".join(f"{i},{i}" for i in range(10)))
    (folder / "part-1.csv").write_text("a,b\n1,2\n3,nan\n5,6\n")
    pq.write_table(pa.table({"a": [1.0, 2.0, float("inf")], "b": [0.0, 1.0, 2.0]}),
                   folder / "more" / "part-2.parquet")
    (folder / "README.txt").write_text("not data")
    assert main(["scan", str(folder), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["file"] for f in report["files"]] == ["more/part-2.parquet", "part-0.csv",
                                                     "part-1.csv"]
    assert report["total"]["rows"] == 16 and report["total"]["nonfinite_cells"] == 2
    assert [f["ok"] for f in report["files"]] == [False, True, False]
    assert main(["scan", str(folder)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "total: 3 files, 0 skipped, 3 tables, 16 rows, 2 nonfinite cells" in out


def test_a_closed_pipe_is_no_error(tmp_path: Path) -> None:
    """`nanguard lint src/ | head`: the reader leaving early is nobody's bug (no traceback)."""
    script = tmp_path / "many.py"
    script.write_text("import torch\n" + "y = torch.log(x)\n" * 3000)  # > a pipe's 64 KB
    proc = subprocess.run(
        f"{sys.executable} -m nanguard lint {script} | head -c 10 >/dev/null; "
        "echo \"rc=${PIPESTATUS[0]}\"",
        shell=True, executable="/bin/bash", capture_output=True, text=True, env=ENV,
        timeout=60)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert "rc=141" in proc.stdout


def test_audit_a_real_trainer_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What transformers really writes: a Trainer's checkpoint-N/ (model.safetensors,
    optimizer.pt, scheduler.pt, rng_state.pth, training_args.bin) and a model saved in
    shards with its index (save_pretrained(max_shard_size=...))."""
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x = torch.randint(0, 64, (16,))
            return {"input_ids": x, "labels": x}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, save_steps=2, report_to=[],
        per_device_train_batch_size=4, use_cpu=True, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Data()).train()
    capsys.readouterr()  # the Trainer's own log lines
    assert main(["audit", str(tmp_path / "out" / "checkpoint-2"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {f["file"] for f in report["files"]} >= {"model.safetensors", "optimizer.pt"}
    assert {s["file"] for s in report["skipped"]} == {"rng_state.pth", "training_args.bin"}
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert main(["audit", str(tmp_path / "sharded"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total"]["files"] > 2 and not report["findings"]
    assert report["total"]["tensors"] == len(model.state_dict()) - sum(
        1 for k in model.state_dict() if k.endswith("lm_head.weight"))  # tied to the embedding
