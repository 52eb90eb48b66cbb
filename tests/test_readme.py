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
    assert demo == "uv run --no-dev --extra demo sdkcore demo"
    assert tests == "uv run pytest"  # the CI script runs this exact command


def test_the_extras_the_first_command_names_exist() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    demo = _first_sh_block()[0].split()
    named = [demo[i + 1] for i, word in enumerate(demo) if word == "--extra"]
    assert named == ["demo"]
    assert all(name in extras for name in named)
    assert [dep.split(">")[0] for dep in extras["grpc"]] == ["grpcio"]
    # the demo's extra: grpcio (through 'grpc'), and what --metrics-port needs
    assert "sdkcore[grpc]" in extras["demo"]


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


# -- issue 21, item 8: README truth and recipes ------------------------------------------


def _run_block(block: Block, tmp_path: Path, extra: str = "") -> subprocess.CompletedProcess[str]:
    """Run a script block, with ``extra`` appended (checks of what the block claims)."""
    path = tmp_path / f"readme_{block.line}_checked.py"
    path.write_text(block.code + textwrap.dedent(extra), encoding="utf-8")
    return subprocess.run(
        [sys.executable, path.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def _sh_commands(text: str) -> list[str]:
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        commands += [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [c for c in commands if c]


def test_the_readme_installs_from_a_checkout_or_a_wheel_never_from_pypi() -> None:
    """sdkcore is not on PyPI: no command may say `pip install sdkcore` / `'sdkcore[...]'`."""
    text = README.read_text(encoding="utf-8")
    commands = _sh_commands(text)
    assert not [c for c in commands if re.search(r"pip install ['\"]?sdkcore\b", c)], commands
    assert "pip install 'sdkcore[" not in text
    assert "not published on PyPI" in text
    assert "uv build --wheel" in commands
    assert "pip install dist/sdkcore-*.whl" in commands


def _recipes() -> list[Block]:
    return [b for b in BLOCKS if b.heading.startswith("Recipes")]


def test_two_recipes_of_at_most_15_lines() -> None:
    flaky, http = _recipes()
    for block in (flaky, http):
        lines = [line for line in block.code.splitlines() if line.strip()]
        assert len(lines) <= 15, (block.heading, len(lines))
    assert "RetryOrchestrator().execute(" in flaky.code
    assert "parse_retry_after(" in http.code
    assert "Retry-After" in http.code


def test_the_http_recipe_waits_what_retry_after_asks(tmp_path: Path) -> None:
    done = _run_block(
        _recipes()[1],
        tmp_path,
        """
        from datetime import timedelta
        assert [a.delay for a in request.attempts] == [timedelta(seconds=1)], request.attempts
        assert request.retry_reasons == (RetryReason.SERVICE_RESPONSE_CODE_INDICATED,)
        """,
    )
    assert done.returncode == 0, done.stderr


def test_the_flaky_recipe_retries_only_idempotent_requests(tmp_path: Path) -> None:
    done = _run_block(
        _recipes()[0],
        tmp_path,
        """
        from sdkcore import RequestCanceledException
        assert request.retry_attempts == 2
        failures.append(ConnectionResetError("again"))
        write = Request(name="write", idempotent=False, timeout=2.5)
        try:
            asyncio.run(RetryOrchestrator().execute(write, send))
        except RequestCanceledException:
            pass
        else:
            raise AssertionError("a write that may have been applied was sent again")
        assert write.retry_attempts == 0
        """,
    )
    assert done.returncode == 0, done.stderr


def test_the_hand_wired_loop_handles_a_breaker_refusal(tmp_path: Path) -> None:
    """`breaker.guard()` raises RetryableError(CIRCUIT_BREAKER_OPEN): maybe_retry takes it."""
    [block] = [b for b in BLOCKS if "orchestrator.maybe_retry(request, exc.reason" in b.code]
    assert block.heading.startswith("…or wire `maybe_retry`")
    assert "breaker.guard():" in block.code
    done = _run_block(
        block,
        tmp_path,
        """
        from datetime import timedelta

        from sdkcore import CircuitState

        breaker = CircuitBreaker(volume_threshold=1, sleep_window=timedelta(milliseconds=50))
        breaker.record_failure(TimeoutError("no reply"))
        assert breaker.state is CircuitState.OPEN
        connection.answers = [b"after the window"]
        request = Request(name="get", idempotent=False, timeout=2.5)  # nothing sent: any may retry
        assert anyio.run(dispatch, request) == b"after the window"
        assert request.retry_reasons == (RetryReason.CIRCUIT_BREAKER_OPEN,)
        assert request.attempts[0].delay >= timedelta(milliseconds=40)  # the breaker's hint
        assert breaker.state is CircuitState.CLOSED  # the probe succeeded
        """,
    )
    assert done.returncode == 0, done.stderr


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_default_backoff_schedule_is_stated_as_the_code_has_it() -> None:
    from sdkcore import best_effort_backoff, controlled_backoff

    flat = _flat(README.read_text(encoding="utf-8"))
    best = [best_effort_backoff(n).total_seconds() * 1000 for n in range(11)]
    assert best == [1, 2, 4, 8, 16, 32, 64, 128, 256, 500, 500]
    assert "1, 2, 4, 8, 16, 32, 64, 128, 256 ms, then 500 ms before every later retry" in flat
    controlled = [controlled_backoff(n).total_seconds() * 1000 for n in range(7)]
    assert controlled == [1, 10, 50, 100, 500, 1000, 1000]
    assert "1, 10, 50, 100, 500 ms, then 1000 ms" in flat
    assert "Neither has jitter" in flat
    # no jitter: the same attempt always gets the same delay
    assert {best_effort_backoff(3) for _ in range(20)} == {best_effort_backoff(3)}


def test_which_exceptions_carry_context_is_true(tmp_path: Path) -> None:
    flat = _flat(README.read_text(encoding="utf-8"))
    assert "Every `CouchbaseException` sdkcore raises carries `.context`" in flat
    assert "fail the request unchanged, without `.context`" in flat
    script = """
import asyncio

from sdkcore import (
    DocumentNotFoundException, Request, RetryableError, RetryOrchestrator, RetryReason,
    UnambiguousTimeoutException,
)

async def main():
    orchestrator = RetryOrchestrator()
    for error, has_context in ((TypeError("bug"), False), (RuntimeError("x"), False),
                               (DocumentNotFoundException(), True)):
        async def send(request, error=error):
            raise error
        try:
            await orchestrator.execute(Request(idempotent=True, timeout=1), send)
        except Exception as exc:
            assert exc is error
            assert (getattr(exc, "context", None) is not None) is has_context, exc
    async def busy(request):
        raise RetryableError(RetryReason.KV_LOCKED)
    try:
        await orchestrator.execute(Request(idempotent=True, timeout=0.05), busy)
    except UnambiguousTimeoutException as exc:
        assert exc.context is not None
    assert not hasattr(RetryableError(RetryReason.KV_LOCKED), "context")

asyncio.run(main())
"""
    path = tmp_path / "context_claims.py"
    path.write_text(script, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, path.name], cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr


def test_asyncio_timeout_is_not_seen_as_the_readme_says(tmp_path: Path) -> None:
    flat = _flat(README.read_text(encoding="utf-8"))
    assert "an enclosing `asyncio.timeout(...)` (or `asyncio.wait_for`) is not seen" in flat
    assert "On trio and anyio, an enclosing cancel scope's deadline" in flat
    script = """
import asyncio

from sdkcore import Request, RetryOrchestrator

seen = []

async def send(request):
    seen.append(request.dispatch_info().time_left)
    return 1

async def main():
    await asyncio.wait_for(RetryOrchestrator().execute(Request(timeout=None), send), 5)

asyncio.run(main())
assert seen == [None], seen
"""
    path = tmp_path / "asyncio_timeout.py"
    path.write_text(script, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, path.name], cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr


#: The generic-failure table's "retried" column, as the core must decide it.
_RETRIED = {"every request": True, "every request, after the hint": True, "idempotent only": False}


def test_the_generic_failure_table_agrees_with_the_core() -> None:
    """Each row's reason and effect, played through the real orchestrator (explain's engine)."""
    from sdkcore import AttemptEffect, RetryReason
    from sdkcore._explain import explain_outcomes

    text = README.read_text(encoding="utf-8")
    table = text.split("| failure in `send` |", 1)[1].split("\n\n", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()[2:]
        if line.startswith("|")
    ]
    checked = 0
    for _failure, raised, effect_cell, retried in rows:
        found = re.match(r"`([A-Z_]+)", raised)
        if found is None:
            assert retried == "never"
            continue
        reason = RetryReason[found.group(1)]
        effect = AttemptEffect[effect_cell.strip("`")]
        explicit = "effect=AttemptEffect." in raised
        assert explicit or effect is AttemptEffect.for_reason(reason), raised
        for outcome in explain_outcomes(reason, effect):
            assert outcome.exception is None or not outcome.idempotent, (raised, outcome)
            if not outcome.idempotent:
                assert (outcome.exception is None) is _RETRIED[retried], (raised, outcome)
        checked += 1
    assert checked == 5


def test_the_when_things_fail_example_is_what_sdkcore_prints() -> None:
    """The README's error context, timings aside, from the same story: locked twice, then cut."""
    import json

    import anyio

    from sdkcore import (
        AmbiguousTimeoutException,
        Request,
        RetryableError,
        RetryOrchestrator,
        RetryReason,
    )

    text = README.read_text(encoding="utf-8")
    shown = text.split("```\nrequest timed out after 2 retries", 1)[1].split("```", 1)[0]
    shown = " ".join(shown.split())
    readme_context = json.loads(shown[shown.index("{") :])

    class Locked(Exception):
        pass

    calls = 0

    async def send(request: Request) -> bytes:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RetryableError(RetryReason.KV_LOCKED) from Locked("k1 locked")
        await anyio.sleep(10)
        return b""

    async def main() -> AmbiguousTimeoutException:
        request = Request(name="kv.replace", idempotent=False, timeout=0.05)
        with pytest.raises(AmbiguousTimeoutException) as caught:
            await RetryOrchestrator().execute(request, send)
        return caught.value

    exc = anyio.run(main)
    assert str(exc).startswith(
        "request timed out after 2 retries (last: KV_LOCKED), attempt 3 in flight at the deadline; "
        "it may have been applied on the server"
    )
    real = json.loads(str(exc)[str(exc).index("{") :])

    def timeless(context: dict[str, object]) -> dict[str, object]:
        out = {k: v for k, v in context.items() if k not in ("request_id", "elapsed_ms")}
        attempts = out.pop("attempts")
        assert isinstance(attempts, list)
        out["attempts"] = [{k: v for k, v in a.items() if k != "duration_ms"} for a in attempts]
        return out

    assert timeless(real) == timeless(readme_context)
