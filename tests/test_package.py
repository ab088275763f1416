"""The package as a user gets it: the wheel built from this tree, installed into a fresh
virtual environment (with the system's site-packages, so torch is the one already installed
and nothing is downloaded), answers `nanguard --version` with the version the source carries,
runs `nanguard demo`, and ships `py.typed`, the report schema and the LICENSE."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source_version() -> str:
    text = (ROOT / "src" / "nanguard" / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    assert match, "nanguard/_version.py carries __version__ as a plain string literal"
    return match.group(1)


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 180) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A venv holding the wheel of this tree; returns its bin folder and a clean environment."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # the build runs offline, on this one
        pytest.skip(f"setuptools {setuptools.__version__} < 77 cannot build the PEP 639 license")
    base = tmp_path_factory.mktemp("package")
    # Build from a copy of what the wheel is made of, so the tree gets no build/ or egg-info.
    src = base / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # PYTHONPATH would shadow the installed package with this tree's source.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    wheels = base / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(wheels), str(src)], env, base)
    (wheel,) = wheels.glob("nanguard-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    # The outer pip installs into the venv (no pip bootstrap: faster, and offline).
    # --ignore-installed: the system may hold nanguard already (an editable install).
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
          "--no-deps", "--ignore-installed", str(wheel)], env, base)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env_dir / "bin", env


def test_installed_version_matches_the_source(installed: tuple[Path, dict[str, str]],
                                              tmp_path: Path) -> None:
    bin_dir, env = installed
    version = _source_version()
    assert _run([str(bin_dir / "nanguard"), "--version"], env, tmp_path).strip() \
        == f"nanguard {version}"
    code = ("import importlib.metadata as m, nanguard; "
            "print(m.version('nanguard'), nanguard.__version__, nanguard.__file__)")
    meta, attr, where = _run([str(bin_dir / "python"), "-c", code], env, tmp_path).split()
    assert meta == attr == version
    assert str(bin_dir.parent) in where, f"nanguard imported from {where}, not the venv"


def test_installed_files(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    bin_dir, env = installed
    code = ("import importlib.metadata as m; d = m.distribution('nanguard'); "
            "print('\\n'.join(str(f) for f in d.files))")
    files = set(_run([str(bin_dir / "python"), "-c", code], env, tmp_path).split())
    assert "nanguard/py.typed" in files
    assert "nanguard/record/report.schema.json" in files
    licenses = [f for f in files if re.search(r"\.dist-info/(licenses/)?LICENSE$", f)]
    assert licenses, sorted(f for f in files if "dist-info" in f)


def test_installed_demo_runs(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    bin_dir, env = installed
    out = tmp_path / "demo"
    stdout = _run([str(bin_dir / "nanguard"), "demo", "--seeds", "2", "--steps", "60",
                   "--out", str(out)], env, tmp_path)
    assert "seeds" in stdout
    assert sorted(p.name for p in out.iterdir() if p.is_dir())[:2] == ["seed-0", "seed-1"]
    assert all((out / f"seed-{s}" / "report.json").is_file() for s in (0, 1))
    # The schema is read from the installed package, not from a source tree.
    schema = json.loads(_run([str(bin_dir / "nanguard"), "report", "--schema"], env, tmp_path))
    assert schema["title"] == "nanguard report.json"
