"""The project's own gates, run with the tests so CI enforces them: mypy --strict and ruff."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy")
    done = _run(sys.executable, "-m", "mypy")  # files and strictness from pyproject.toml
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    done = _run(ruff, "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr
    done = _run(ruff, "format", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr
