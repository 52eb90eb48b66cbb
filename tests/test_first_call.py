"""The first request of a fresh process reaches ``send`` within a tight deadline."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import {loop}
    import sdkcore

    async def main():
        orchestrator = sdkcore.RetryOrchestrator()
        request = sdkcore.Request(timeout=0.05)  # its clock starts now
        sent = []

        async def send(r):
            sent.append(r.dispatch_info().attempt)
            return "ok"

        result = await orchestrator.execute(request, send)
        assert result == "ok" and sent == [1], (result, sent)
        assert "anyio" not in sys.modules, "the core must not load anyio on a request's path"
        print("reached send")

    {run}
    """
)


@pytest.mark.parametrize(
    ("loop", "run"), [("asyncio", "asyncio.run(main())"), ("trio", "trio.run(main)")]
)
def test_the_first_call_of_a_process_reaches_send(loop: str, run: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(loop=loop, run=run)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("reached send")


LEAN = textwrap.dedent(
    """
    import sys
    import sdkcore

    loaded = sorted(
        m for m in sys.modules if m.split(".")[0] in ("json", "grpc", "anyio", "asyncio", "trio")
    )
    assert loaded == [], f"import sdkcore loaded {{loaded}}"

    import {loop}

    async def main():
        async def send(r):
            raise sdkcore.RetryableError(sdkcore.RetryReason.KV_LOCKED) from OSError("reset")

        try:  # retried until its deadline: backoff, timeout, the error and its context
            await sdkcore.RetryOrchestrator().execute(sdkcore.Request(timeout=0.03), send)
        except sdkcore.TimeoutException as exc:
            assert "json" not in sys.modules, "a failing request loaded json"
            return exc
        raise AssertionError("not timed out")

    error = {run}
    text = str(error)  # rendering the context for a person imports json, and only that
    assert "json" in sys.modules and '"request_name": "request"' in text, text
    print("lean")
    """
)


@pytest.mark.parametrize(
    ("loop", "run"), [("asyncio", "asyncio.run(main())"), ("trio", "trio.run(main)")]
)
def test_import_and_a_failing_request_leave_json_out(loop: str, run: str) -> None:
    """json is imported when an error context is rendered as text (``str(exc)``), not by
    ``import sdkcore`` nor on a request's path (bench/bench_import.py measures the import)."""
    out = subprocess.run(
        [sys.executable, "-c", LEAN.format(loop=loop, run=run)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lean"
