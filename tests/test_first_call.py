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
