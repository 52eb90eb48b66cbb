"""Every ```python block in README.md runs.

A block that defines ``test_*`` functions is a pytest example: it is written to a
file and run by pytest. Any other block runs as a script. Each runs in a fresh
subprocess (its own interpreter, so nothing leaks between blocks) with a timeout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT = 120

#: Headings (prefixes) of README sections whose blocks are known not to run yet. Each is
#: an xfail(strict=True): once its block runs, the test fails until it leaves this list.
KNOWN_FAILING: tuple[str, ...] = ()


@attrs.frozen
class Block:
    heading: str
    line: int
    code: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")[:40]
        return f"L{self.line}-{slug}"

    @property
    def is_pytest(self) -> bool:
        return re.search(r"^(async )?def test_", self.code, re.MULTILINE) is not None


def blocks(text: str) -> list[Block]:
    found: list[Block] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.strip() == "```python":
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            # a block inside a list item is indented like its fence
            code = textwrap.dedent("\n".join(lines[start:end]))
            found.append(Block(heading, start + 1, code + "\n"))
            i = end
        i += 1
    return found


BLOCKS = blocks(README.read_text(encoding="utf-8"))


def _params() -> list[object]:
    params: list[object] = []
    for block in BLOCKS:
        marks = []
        if any(block.heading.startswith(h) for h in KNOWN_FAILING):
            marks.append(pytest.mark.xfail(reason="listed in KNOWN_FAILING", strict=True))
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


def test_the_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 5
    assert any(b.is_pytest for b in BLOCKS)
    for heading in KNOWN_FAILING:  # an entry whose section is gone must go too
        assert any(b.heading.startswith(heading) for b in BLOCKS), heading


def test_block_extraction() -> None:
    text = (
        "# A\n```python\nx = 1\n```\n## B\n```sh\nls\n```\n```python\ndef test_x(): pass\n```\n"
        "* item:\n\n  ```python\n  if x:\n      y = 2\n  ```\n"
    )
    got = blocks(text)
    assert [(b.heading, b.line, b.code, b.is_pytest) for b in got] == [
        ("A", 3, "x = 1\n", False),
        ("B", 10, "def test_x(): pass\n", True),
        ("B", 15, "if x:\n    y = 2\n", False),
    ]


@pytest.mark.parametrize("block", _params())
def test_readme_block_runs(block: Block, tmp_path: Path) -> None:
    header = f"# README.md line {block.line} ({block.heading})\n"
    if block.is_pytest:
        path = tmp_path / f"test_readme_{block.line}.py"
        path.write_text(header + block.code, encoding="utf-8")
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path.name]
    else:
        path = tmp_path / f"readme_{block.line}.py"
        path.write_text(header + block.code, encoding="utf-8")
        args = [sys.executable, path.name]
    done = subprocess.run(
        args, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert done.returncode == 0, f"README.md line {block.line}:\n{done.stdout}\n{done.stderr}"


# -- the commands a new user runs first ------------------------------------------------

DEV_ONLY = ("rich", "pytest", "hypothesis", "trio", "opentelemetry", "google", "mypy", "ruff")


def _first_sh_block() -> list[str]:
    text = README.read_text(encoding="utf-8")
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_first_commands_are_the_demo_without_dev_tools_then_the_tests() -> None:
    demo, tests = _first_sh_block()
    assert demo == "uv run --no-dev --extra grpc sdkcore demo"
    assert tests == "uv run pytest"  # the CI script runs this exact command


def test_the_extras_the_first_command_names_exist() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    demo = _first_sh_block()[0].split()
    named = [demo[i + 1] for i, word in enumerate(demo) if word == "--extra"]
    assert named == ["grpc"]
    assert all(name in extras for name in named)
    assert [dep.split(">")[0] for dep in extras["grpc"]] == ["grpcio"]


def test_the_demo_runs_with_only_the_core_dependencies_and_grpcio() -> None:
    """What `--no-dev --extra grpc` installs is enough: the dev group's packages are refused."""
    pytest.importorskip("grpc")
    refuse = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {DEV_ONLY!r}:
            raise ImportError(f"{{name}} is not installed by --no-dev --extra grpc", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from sdkcore._cli import main
sys.exit(main(["demo", "--scenario", "locked", "--json"]))
"""
    done = subprocess.run(
        [sys.executable, "-c", refuse], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert '"ok": true' in done.stdout


def test_the_check_config_example_is_shipped_and_valid() -> None:
    text = README.read_text(encoding="utf-8")
    named = re.findall(r"sdkcore check-config (\S+)", text)
    assert named == ["examples/service_config.json"]
    done = subprocess.run(
        [sys.executable, "-m", "sdkcore", "check-config", named[0]],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no warnings either
    assert "valid gRPC service config, 3 methodConfigs" in done.stdout


def test_the_readme_says_the_otel_snippet_needs_the_sdk() -> None:
    text = README.read_text(encoding="utf-8")
    snippet = next(b for b in BLOCKS if "opentelemetry.sdk" in b.code)
    before = text[: text.index(snippet.code.splitlines()[0])]
    assert "pip install opentelemetry-sdk" in before[-800:]


def test_the_readme_shows_installing_from_a_checkout() -> None:
    text = README.read_text(encoding="utf-8")
    assert "uv add /path/to/sdkcore" in text
    assert "pip install -e /path/to/sdkcore" in text
