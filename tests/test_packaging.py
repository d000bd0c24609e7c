"""The package installs beyond the Python it is developed on: GPU machines commonly run Python 3.12 or 3.13."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import PROJECT_ROOT

PACKAGES = ["algos", "models", "experiments", "analysis", "benchmarks"]


def _interpreters() -> list[str]:
    """python3.12 / python3.13 on PATH, or installed by pyenv (whose shims only answer for the selected version)."""
    found = []
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in ("3.12", "3.13"):
        candidates = [
            shutil.which(f"python{version}"),
            *sorted(map(str, pyenv.glob(f"{version}*/bin/python{version}"))),
        ]
        for path in filter(None, candidates):
            if subprocess.run([path, "-c", "import pip"], capture_output=True).returncode == 0:
                found.append(path)
                break
    return found


@pytest.mark.slow
@pytest.mark.parametrize("python", _interpreters() or [None])
def test_the_wheel_installs_and_the_sources_compile_on_newer_pythons(python, tmp_path):
    if python is None:
        pytest.skip("no python3.12 or python3.13 with pip on this machine")
    source = tmp_path / "source"  # a copy: setuptools writes build/ and *.egg-info next to what it builds
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(PROJECT_ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(PROJECT_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(Path(tmp_path).glob("moe_rl_lab-*.whl"))
    # pip refuses a wheel whose Requires-Python excludes the interpreter; --no-deps: torch and friends are the
    # target machine's own, and nothing is downloaded.
    install = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0 and "Would install moe-rl-lab" in install.stdout, install.stderr[-2000:]
    compiled = subprocess.run(
        [python, "-m", "compileall", "-q", *PACKAGES], capture_output=True, text=True, cwd=source, timeout=300
    )
    assert compiled.returncode == 0, compiled.stdout[-2000:] + compiled.stderr[-2000:]
