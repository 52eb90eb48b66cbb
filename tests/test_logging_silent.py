"""A library prints nothing by itself (issue "Every edge holds", item 12).

An application that configured no logging at all (neither ``logging`` nor structlog)
must see nothing on stdout or stderr, whatever sdkcore logs: the ``sdkcore`` stdlib
logger carries a ``logging.NullHandler``, so ``logging.lastResort`` never prints a
warning-level event. Each case runs in a fresh interpreter (logging is process-global).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

#: Every event sdkcore emits: retry.* from the orchestrator, hedge.* from the hedging runner.
EVERY_EVENT = {
    "retry.scheduled",
    "retry.not_retried",
    "retry.timed_out",
    "retry.strategy_failed",
    "hedge.sent",
    "hedge.won",
    "hedge.failed",
    "hedge.cancelled",
}

EMIT_EVERY_EVENT = """
import anyio
from sdkcore import (
    HedgePolicy, Request, RetryOrchestrator, RetryReason, RetryableError,
)
from sdkcore.testing import ScriptedSend

class Broken:
    def retry_after(self, request, reason):
        raise RuntimeError("strategy lookup failed")

async def main():
    orchestrator = RetryOrchestrator()
    # retry.scheduled (debug) x3, then success
    send = ScriptedSend([RetryReason.KV_LOCKED] * 3 + ["value"])
    await orchestrator.execute(Request(name="kv.get", idempotent=True), send)
    # retry.not_retried (info): a non-idempotent request is never retried for UNKNOWN
    try:
        await orchestrator.execute(Request(name="kv.upsert"), ScriptedSend([RetryReason.UNKNOWN]))
    except Exception:
        pass
    # retry.timed_out (info)
    try:
        await orchestrator.execute(
            Request(name="kv.get", idempotent=True, timeout=0.05),
            ScriptedSend([RetryReason.KV_LOCKED]),
        )
    except Exception:
        pass
    # retry.strategy_failed (warning): the one event logging.lastResort would print
    try:
        await RetryOrchestrator(default_strategy=Broken()).execute(
            Request(name="kv.get", idempotent=True), ScriptedSend([RetryReason.KV_LOCKED])
        )
    except Exception:
        pass
    # hedge.sent, hedge.failed, hedge.won, hedge.cancelled
    async def replica(request, index):
        if index == 0:
            raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)
        if index == 1:
            await anyio.sleep(5)
        return index

    policy = HedgePolicy(max_attempts=3, delay=0.02)
    request = Request(name="kv.get_replica", idempotent=True, timeout=3)
    await orchestrator.hedge(request, replica, policy)

anyio.run(main)
"""


def run(prelude: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(prelude) + EMIT_EVERY_EVENT
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )


def test_the_script_emits_every_event_when_logging_is_on() -> None:
    """What the silent run below is silent about: all eight events are emitted."""
    done = run(
        """
        import atexit, json, logging, sys
        seen = set()
        class Keep(logging.Handler):
            def emit(self, record):
                seen.add(record.getMessage().split(" ", 1)[0])
        logger = logging.getLogger("sdkcore")
        logger.addHandler(Keep())
        logger.setLevel(logging.DEBUG)
        atexit.register(lambda: sys.stdout.write(json.dumps(sorted(seen))))
        """
    )
    assert set(json.loads(done.stdout)) == EVERY_EVENT


def test_an_unconfigured_application_sees_nothing() -> None:
    done = run("")
    assert done.stdout == ""
    assert done.stderr == ""


def test_the_sdkcore_logger_has_a_null_handler() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import logging, sdkcore; "
            "print([type(h).__name__ for h in logging.getLogger('sdkcore').handlers])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "['NullHandler']"
