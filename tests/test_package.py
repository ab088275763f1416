"""The package as a user gets it: the wheel built from this tree, installed into a fresh virtual
environment, answers `nanguard --version` with the version the source carries, runs `nanguard
demo`, and ships `py.typed`, the report schema and the LICENSE.

The venv has no system site-packages: from inside a venv those would be the *base*
interpreter's, which lacks nanguard's dependencies on a fresh machine (`No module named
'rich'`). Instead a `.pth` file puts the running environment's site-packages after the venv's
own, so torch, rich and numpy are the ones already installed, nothing is downloaded, and the
wheel (installed into the venv, ahead of them) is what gets imported. The wheel is built and
installed once per session, shared by the xdist workers through a file lock."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from filelock import FileLock

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


def _build_and_install(base: Path, env: dict[str, str]) -> Path:
    """Build the wheel of this tree and install it into a new venv under `base`; its bin/."""
    import setuptools

    # pyproject's build-system needs >= 77 (the PEP 639 license); the build runs offline, on
    # the one installed (torch's dependency brings it with the dev extra). Fail, not skip: a
    # skip would hide that the package test never ran.
    assert int(setuptools.__version__.split(".")[0]) >= 77, (
        f"setuptools {setuptools.__version__} < 77 cannot build the wheel (PEP 639 license); "
        "pip install 'setuptools>=77'")
    # Build from a copy of what the wheel is made of, so the tree gets no build/ or egg-info.
    src = base / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = base / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(wheels), str(src)], env, base)
    (wheel,) = wheels.glob("nanguard-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, system_site_packages=False, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   env, base).strip()
    # Plain path lines: the running environment's own .pth files (an editable nanguard among
    # them) are not processed, so its nanguard stays out of sight.
    outer = [p for p in dict.fromkeys(site.getsitepackages()) if Path(p).is_dir()]
    (Path(purelib) / "_running_env.pth").write_text("".join(f"{p}\n" for p in outer))
    # The outer pip installs into the venv (no pip bootstrap: faster, and offline).
    # --ignore-installed: the running environment may hold nanguard (an editable install),
    # visible through the .pth, and must not be uninstalled from there.
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
          "--no-deps", "--ignore-installed", str(wheel)], env, base)
    return env_dir / "bin"


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A venv holding the wheel of this tree; returns its bin folder and a clean environment.

    Built once per session: under xdist the workers share the base temp folder's parent, and
    the first to take the lock builds while the others wait for it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    base = root / "package"
    # PYTHONPATH would shadow the installed package with this tree's source.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with FileLock(str(root / "package.lock")):
        done = base / "built"
        if not done.is_file():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            bin_dir = _build_and_install(base, env)
            done.write_text(str(bin_dir))
        bin_dir = Path(done.read_text())
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return bin_dir, env


def test_the_venv_reaches_nothing_outside_the_running_environment(
        installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    bin_dir, env = installed
    cfg = (bin_dir.parent / "pyvenv.cfg").read_text()
    assert re.search(r"^include-system-site-packages = false$", cfg, re.MULTILINE), cfg
    code = "import rich, torch; print(rich.__file__); print(torch.__file__)"
    here = {str(Path(p).resolve()) for p in site.getsitepackages()}
    for where in _run([str(bin_dir / "python"), "-c", code], env, tmp_path).split():
        assert str(Path(where).resolve().parents[1]) in here, where


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
