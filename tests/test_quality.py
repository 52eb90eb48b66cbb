"""The project's own gates, run with the tests so CI enforces them: mypy --strict and ruff."""

from __future__ import annotations

import os
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


# The test directories, each checked alone: each has its own conftest.py, a module name
# mypy allows once per run; and what each imports beside it (MYPYPATH, as pytest's rootdir
# import mode puts each test's directory on sys.path).
_TEST_DIRS = {"tests": ".:memcached", "tests/grpc_a6": ".:..", "tests/memcached": ".:.."}


@pytest.mark.parametrize("directory", sorted(_TEST_DIRS))
def test_mypy_strict_is_clean_on_the_tests(directory: str) -> None:
    pytest.importorskip("mypy")
    here = ROOT / directory
    files = sorted(path.name for path in here.glob("*.py"))
    assert files, f"no test files in {here}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(ROOT / ".mypy_cache" / directory.replace("/", "-")),  # one per conftest.py
            *files,
        ],
        cwd=here,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MYPYPATH": _TEST_DIRS[directory]},
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    done = _run(ruff, "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr
    done = _run(ruff, "format", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr
