"""Edges of the core that must hold under careless or hostile input (sync door, errors, help)."""

from __future__ import annotations

import pydoc
import threading
import time
import warnings
from typing import Any

import pytest

import sdkcore
from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    BestEffortRetryStrategy,
    Request,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
    UnambiguousTimeoutException,
)
from sdkcore.testing import capture_retry_events

pytestmark = pytest.mark.anyio  # async tests run on asyncio and trio (tests/conftest.py)

# -- item 3: an unambiguous timeout says what is true --------------------------------------


async def test_idempotent_timeout_after_a_maybe_applied_attempt_says_safe_to_retry() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(idempotent=True, timeout=0.05)

    async def send(_: Request) -> None:
        raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)

    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.execute(req, send)
    text = str(info.value)
    assert '"effect": "maybe_applied"' in text
    assert "not applied on the server" not in text
    assert "idempotent, so it is safe to retry" in text


async def test_timeout_of_an_attempt_never_sent_still_says_not_applied() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(idempotent=False, timeout=0.05)

    async def send(_: Request) -> None:
        raise RetryableError(RetryReason.SOCKET_NOT_AVAILABLE)

    with pytest.raises(UnambiguousTimeoutException, match="not applied on the server"):
        await orch.execute(req, send)


# -- item 4: the sync door holds no orchestrator-wide lock while user code runs ------------


class _Slow(BestEffortRetryStrategy):
    """Blocks inside its decision until released (for the request named "slow")."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.name == "slow":
            self.entered.set()
            self.release.wait(5)
        return super().decide(request, reason)


def test_a_slow_strategy_in_one_thread_does_not_stall_another_threads_retry() -> None:
    strategy = _Slow()
    orch = RetryOrchestrator(strategy)
    done: dict[str, float] = {}

    def run(name: str) -> None:
        calls = [0]

        def send(_: Request) -> str:
            calls[0] += 1
            if calls[0] == 1:
                raise RetryableError(RetryReason.KV_LOCKED)
            return "ok"

        start = time.monotonic()
        orch.execute_sync(Request(name=name, idempotent=True, timeout=3), send)
        done[name] = time.monotonic() - start

    slow = threading.Thread(target=run, args=("slow",))
    slow.start()
    assert strategy.entered.wait(5)
    fast = threading.Thread(target=run, args=("fast",))
    fast.start()
    fast.join(2)
    try:
        assert not fast.is_alive(), "the fast request waited for the slow strategy"
        assert done["fast"] < 1.0
    finally:
        strategy.release.set()
        slow.join(5)
    assert orch.requests_in_retry == 0


def test_a_strategy_may_call_execute_sync_on_the_same_orchestrator() -> None:
    orch: RetryOrchestrator

    class Nested(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            if request.name == "outer":  # e.g. a strategy that refreshes a config first
                orch.execute_sync(Request(name="inner", timeout=1), lambda _: "config")
            return super().decide(request, reason)

    orch = RetryOrchestrator(Nested())
    calls = [0]

    def send(_: Request) -> str:
        calls[0] += 1
        if calls[0] == 1:
            raise RetryableError(RetryReason.KV_LOCKED)
        return "ok"

    result: list[str] = []
    worker = threading.Thread(
        target=lambda: result.append(
            orch.execute_sync(Request(name="outer", idempotent=True, timeout=2), send)
        )
    )
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "deadlock: the strategy's nested execute_sync never returned"
    assert result == ["ok"]


# -- item 5: whatever send raises after the deadline is the timeout -------------------------


@pytest.mark.parametrize(
    ("effect", "ambiguous"),
    [(None, False), (AttemptEffect.NOT_SENT, False), (AttemptEffect.MAYBE_APPLIED, True)],
    ids=["KV_LOCKED's own effect", "not sent", "maybe applied"],
)
def test_a_retryable_error_raised_after_the_deadline_is_the_timeout(
    effect: AttemptEffect | None, ambiguous: bool
) -> None:
    orch = RetryOrchestrator()
    req = Request(name="kv.upsert", idempotent=False, timeout=0.05)

    def send(_: Request) -> None:
        time.sleep(0.1)  # blocks past the deadline, then fails retryably
        raise RetryableError(RetryReason.KV_LOCKED, effect=effect) from OSError("locked")

    with pytest.raises(TimeoutException) as info:
        orch.execute_sync(req, send)
    # The attempt ended with an answer, booked with the effect it reported (KV_LOCKED: the
    # server did not apply it), as execute books it: ambiguous only if it may have been applied.
    assert isinstance(info.value, AmbiguousTimeoutException) is ambiguous
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.context is not None
    assert not info.value.context.in_flight
    assert [a.reason for a in req.attempts] == [RetryReason.KV_LOCKED]


# -- item 6: a sync refinement of a built-in strategy ---------------------------------------


def test_a_sync_subclass_refines_a_builtin_through_decide_on_both_doors() -> None:
    class NoRobots(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            if request.client_context.get("robot"):
                return RetryAction.no_retry()
            return super().decide(request, reason)

    orch = RetryOrchestrator(NoRobots())
    calls = [0]

    def send(_: Request) -> str:
        calls[0] += 1
        if calls[0] < 3:
            raise RetryableError(RetryReason.KV_LOCKED)
        return "ok"

    with warnings.catch_warnings(), capture_retry_events() as events:
        warnings.simplefilter("error")
        assert orch.execute_sync(Request(idempotent=True, timeout=1), send) == "ok"
        calls[0] = 0
        with pytest.raises(sdkcore.RequestCanceledException):
            orch.execute_sync(
                Request(idempotent=True, timeout=1, client_context={"robot": True}), send
            )
    assert calls[0] == 1  # the robot's request was not retried
    assert not [e for e in events if e["event"] == "retry.strategy_failed"]


def test_a_plain_retry_after_calling_super_decide_works_on_the_sync_door() -> None:
    class Plain(BestEffortRetryStrategy):
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:  # type: ignore[override]
            return super().decide(request, reason)

    calls = [0]

    def send(_: Request) -> str:
        calls[0] += 1
        if calls[0] < 2:
            raise RetryableError(RetryReason.KV_LOCKED)
        return "ok"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RetryOrchestrator(Plain()).execute_sync(Request(idempotent=True), send) == "ok"


# -- item 7: the user's own exception, even when it misbehaves ------------------------------


class _Hostile(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


async def test_a_strategy_raising_an_exception_with_broken_str_reaches_the_caller() -> None:
    hostile = _Hostile()

    class Raises(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            raise hostile

    async def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    with capture_retry_events() as events, pytest.raises(_Hostile) as info:
        await RetryOrchestrator(Raises()).execute(Request(idempotent=True), send)
    assert info.value is hostile
    (failed,) = [e for e in events if e["event"] == "retry.strategy_failed"]
    assert failed["error"] == "_Hostile"


async def test_send_raising_an_exception_with_broken_str_reaches_the_caller() -> None:
    hostile = _Hostile()

    async def send(_: Request) -> None:
        raise hostile

    req = Request(idempotent=True)
    with pytest.raises(_Hostile) as info:
        await RetryOrchestrator().execute(req, send)
    assert info.value is hostile
    assert req.attempts[-1].error == "_Hostile"


# -- item 11: the driver error under a final exception appears in the context ---------------


async def test_a_final_error_chained_from_a_driver_error_shows_the_driver_error() -> None:
    async def send(_: Request) -> None:
        try:
            raise ConnectionResetError("peer reset the connection")
        except ConnectionResetError as driver:
            raise sdkcore.DocumentNotFoundException("no such key") from driver

    with pytest.raises(sdkcore.DocumentNotFoundException) as info:
        await RetryOrchestrator().execute(Request(name="kv.get"), send)
    context = info.value.context
    assert context is not None
    assert context.last_error is not None
    assert "ConnectionResetError: peer reset the connection" in context.last_error


# -- item 19: help() and tracebacks name public classes sdkcore.X ---------------------------


@pytest.mark.parametrize(
    "cls",
    [RetryOrchestrator, Request, RetryAction, BestEffortRetryStrategy, TimeoutException],
)
def test_public_classes_show_as_sdkcore_names(cls: Any) -> None:
    assert cls.__module__ == "sdkcore"
    page = pydoc.render_doc(cls, renderer=pydoc.plaintext)  # type: ignore[attr-defined]  # not in typeshed
    assert "sdkcore._" not in page.splitlines()[0]


def test_help_of_the_orchestrator_lists_no_private_members() -> None:
    page = pydoc.render_doc(RetryOrchestrator, renderer=pydoc.plaintext)  # type: ignore[attr-defined]
    private = [
        line.strip() for line in page.splitlines() if line.strip().startswith(("_a", "_s", "_l"))
    ]
    assert private == []
    assert "execute_sync(" in page
    assert "maybe_retry(" in page


# -- the asyncio deadline heap stays bounded with long timeouts ------------------------------


def test_closed_deadlines_do_not_pile_up_until_their_time() -> None:
    import asyncio

    from sdkcore._runtime import _asyncio as backend

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for _ in range(50_000):  # each request answered long before its 75 s deadline
            backend.Scope(loop.time() + 75.0).exit(None)
        live = [backend.Scope(loop.time() + 75.0) for _ in range(10)]
        size = len(backend._deadlines(loop).heap)
        for scope in live:
            scope.exit(None)
        return size

    size = asyncio.run(main())
    assert size <= 2 * backend._COMPACT_MIN  # not 50,010


def test_a_finished_burst_leaves_its_deadlines_behind_at_once() -> None:
    """Issue 21: 10,000 concurrent requests with 30 s timeouts all answered; before, their
    closed entries (about 2 MB) stayed in the heap for 30 s. Now the heap drops them as
    soon as closed entries outnumber open ones, with no deadline having passed."""
    import asyncio

    from sdkcore import Request, RetryOrchestrator
    from sdkcore._runtime import _asyncio as backend

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        release = asyncio.Event()
        orchestrator = RetryOrchestrator()

        async def send(request: Request) -> bytes:
            await release.wait()
            return b"ok"

        calls = [
            asyncio.ensure_future(orchestrator.execute(Request(timeout=30.0), send))
            for _ in range(10_000)
        ]
        await asyncio.sleep(0)
        during = len(backend._deadlines(loop).heap)
        release.set()
        await asyncio.gather(*calls)
        return during, len(backend._deadlines(loop).heap)

    during, after = asyncio.run(main())
    assert during >= 10_000  # every request held a deadline while in flight
    assert after < backend._COMPACT_MIN  # not 10,000 until 30 s have passed
