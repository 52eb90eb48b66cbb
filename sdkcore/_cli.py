"""The ``sdkcore`` command line: ``sdkcore demo`` and ``sdkcore version``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import anyio
import structlog

from ._action import RetryAction
from ._errors import CouchbaseException
from ._orchestrator import RetryOrchestrator
from ._reason import RetryReason
from ._request import Request
from ._strategy import (
    BestEffortRetryStrategy,
    FailFastRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
    RetryStrategy,
)
from .testing import ScriptedSend

__all__ = ["main"]

R = RetryReason


class NoRobots(BestEffortRetryStrategy):
    """The RFC's example: never retry requests flagged as coming from a robot."""

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.client_context.get("isRobotRequest"):
            return RetryAction.no_retry()
        return await super().retry_after(request, reason)


# (title, request kwargs, script of attempt outcomes)
SCENARIOS: list[tuple[str, dict[str, Any], list[Any]]] = [
    (
        "get: NOT_MY_VBUCKET twice, then the value",
        {"name": "get", "idempotent": True},
        [R.KV_NOT_MY_VBUCKET, R.KV_NOT_MY_VBUCKET, b"value"],
    ),
    (
        "upsert: socket closed while in flight",
        {"name": "upsert", "idempotent": False},
        [R.SOCKET_CLOSED_WHILE_IN_FLIGHT, b"stored"],
    ),
    (
        "get: socket closed while in flight, then the value",
        {"name": "get", "idempotent": True},
        [R.SOCKET_CLOSED_WHILE_IN_FLIGHT, b"value"],
    ),
    (
        "upsert: locked, locked, then stored",
        {"name": "upsert", "idempotent": False},
        [R.KV_LOCKED, R.KV_LOCKED, b"stored"],
    ),
    (
        "get (timeout 150 ms): bad credentials (AUTHENTICATION_ERROR) on every attempt",
        {"name": "get", "idempotent": True, "timeout": 0.15},
        [R.AUTHENTICATION_ERROR],
    ),
    (
        "get from a robot: temporary failure, then the value",
        {"name": "get", "idempotent": True, "client_context": {"isRobotRequest": True}},
        [R.KV_TEMPORARY_FAILURE, b"value"],
    ),
]

STRATEGIES: list[tuple[str, Callable[[], RetryStrategy]]] = [
    ("FastFailOnTerminalError (default)", FastFailOnTerminalErrorRetryStrategy),
    ("BestEffort", BestEffortRetryStrategy),
    ("FailFast (internal)", FailFastRetryStrategy),
    ("NoRobots (BestEffort subclass)", NoRobots),
]


def _write(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _event_line(event: MutableMapping[str, Any]) -> str:
    fields = " ".join(
        f"{k}={event[k]}"
        for k in ("reason", "attempt", "delay_ms", "capped", "cancellation_reason", "ambiguous")
        if k in event
    )
    return f"      {event.get('log_level', ''):<5} {event['event']:<18} {fields}"


async def _demo(show_events: bool) -> int:
    events: list[MutableMapping[str, Any]] = []

    def collect(_: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        event_dict["log_level"] = method
        events.append(dict(event_dict))
        raise structlog.DropEvent

    was_configured = structlog.is_configured()
    old = structlog.get_config()
    # The demo is an application: it may configure structlog (the library never does).
    structlog.configure(
        processors=[collect], wrapper_class=structlog.make_filtering_bound_logger(0)
    )
    try:
        return await _run_scenarios(events, show_events)
    finally:
        if was_configured:
            structlog.configure(**old)
        else:
            structlog.reset_defaults()


async def _run_scenarios(events: list[MutableMapping[str, Any]], show_events: bool) -> int:
    failures = 0
    for title, kwargs, script in SCENARIOS:
        _write(f"\n== {title}")
        for label, make in STRATEGIES:
            orchestrator = RetryOrchestrator(default_strategy=make())
            request = Request(**{"timeout": 1.0, **kwargs})
            send = ScriptedSend(script)
            events.clear()
            start = time.perf_counter()
            try:
                result = await orchestrator.execute(request, send)
                outcome = f"ok {result!r}"
            except CouchbaseException as exc:
                outcome = f"{type(exc).__name__}"
            except Exception as exc:  # the demo must report, not crash
                outcome = f"unexpected {type(exc).__name__}: {exc}"
                failures += 1
            elapsed = (time.perf_counter() - start) * 1000
            reasons = ",".join(r.name for r in request.retry_reasons) or "-"
            _write(
                f"  {label:<34} -> {outcome:<32} attempts={send.calls} "
                f"retries={request.retry_attempts} reasons={reasons} {elapsed:.0f} ms"
            )
            if show_events:
                for event in events:
                    _write(_event_line(event))
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sdkcore", description="sdkcore: retry handling core")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="drive scripted failures through each retry strategy and show the log events"
    )
    demo.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    demo.add_argument("--quiet", action="store_true", help="hide the log events")
    sub.add_parser("version", help="print the installed version")
    args = parser.parse_args(argv)
    if args.command == "version":
        from importlib.metadata import version

        _write(version("sdkcore"))
        return 0
    _write("sdkcore demo: a scripted in-process failure source driven through")
    _write("RetryOrchestrator.execute, once per retry strategy (timeout 1 s unless shown).")
    return anyio.run(_demo, not args.quiet, backend=args.backend)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
