"""A RetryableError is booked the same way on every door: ``execute``, ``execute_sync`` and
``maybe_retry(cause=...)`` keep its own cause as the attempt's failure (the final
``__cause__`` and the context's ``last_error``), and its effect and hint (rfc/0001)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from fuzz_kit import CountingBudget

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    CouchbaseException,
    FailFastRetryStrategy,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
    UnambiguousTimeoutException,
)
from sdkcore.testing import VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio

TEMP = RetryReason.KV_TEMPORARY_FAILURE


def failure() -> RetryableError:
    try:
        raise ConnectionResetError("peer reset")
    except ConnectionResetError as exc:
        return RetryableError(TEMP, "reset", cause=exc)


def fail_fast(**kwargs: object) -> Request:
    return Request(name="kv.get", retry_strategy=FailFastRetryStrategy(), **kwargs)  # type: ignore[arg-type]


async def test_maybe_retry_books_a_retryable_errors_own_cause_as_execute_does() -> None:
    orchestrator = RetryOrchestrator()

    async def send(_: Request) -> None:
        raise failure()

    with pytest.raises(RequestCanceledException) as by_execute:
        await orchestrator.execute(fail_fast(idempotent=True), send)

    request = fail_fast(idempotent=True)
    with pytest.raises(RequestCanceledException) as by_hand:
        await orchestrator.maybe_retry(request, TEMP, cause=failure())

    for info in (by_execute, by_hand):
        assert type(info.value.__cause__) is ConnectionResetError
        assert info.value.context is not None
        assert info.value.context.last_error == "ConnectionResetError: peer reset"
    assert type(request.last_error) is ConnectionResetError


def test_execute_sync_books_the_same_cause() -> None:
    def send(_: Request) -> None:
        raise failure()

    with pytest.raises(RequestCanceledException) as info:
        RetryOrchestrator().execute_sync(fail_fast(idempotent=True), send)
    assert type(info.value.__cause__) is ConnectionResetError


async def test_maybe_retry_takes_the_errors_effect_unless_given() -> None:
    # SERVICE_NOT_AVAILABLE alone lets a non-idempotent request retry (nothing was sent);
    # the error says MAYBE_APPLIED, which narrows it: never sent twice (rfc/0001).
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.replace", idempotent=False, timeout=1.0)
    applied = RetryableError(RetryReason.SERVICE_NOT_AVAILABLE, effect=AttemptEffect.MAYBE_APPLIED)
    with pytest.raises(RequestCanceledException, match="may have been applied"):
        await orchestrator.maybe_retry(request, applied.reason, cause=applied)
    assert request.maybe_applied

    # The effect given explicitly wins over the error's.
    request = Request(name="kv.replace", idempotent=False, timeout=0.001)

    async def retry_until_it_ends() -> None:
        while True:
            await orchestrator.maybe_retry(
                request, applied.reason, cause=applied, effect=AttemptEffect.NOT_SENT
            )

    with pytest.raises(UnambiguousTimeoutException):
        await retry_until_it_ends()
    assert not request.maybe_applied


def test_execute_sync_names_an_async_decide_as_the_method_to_fix() -> None:
    class AsyncDecide(FailFastRetryStrategy):
        async def decide(self, request: Request, reason: RetryReason) -> Any:  # type: ignore[override]
            raise AssertionError("never awaited")

    def send(_: Request) -> None:
        raise RetryableError(TEMP)

    with pytest.raises(TypeError) as info:
        RetryOrchestrator().execute_sync(Request(retry_strategy=AsyncDecide()), send)
    assert "AsyncDecide.decide returned an awaitable" in str(info.value)
    assert "Make its decide a plain def" in str(info.value)


def test_execute_sync_waits_on_the_orchestrators_virtual_clock() -> None:
    # Before: time.sleep never moved the virtual clock, and the request retried forever.
    clock = VirtualClock()
    orchestrator = RetryOrchestrator(sleep=clock.sleep)
    request = Request(idempotent=True, timeout=1.0, clock=clock.clock)

    def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    with pytest.raises(UnambiguousTimeoutException):
        orchestrator.execute_sync(request, send)
    assert clock.now - 1000.0 >= 1.0  # the waits moved the clock to the deadline
    assert sum(clock.sleeps) >= 0.99


def test_execute_sync_on_a_virtual_clock_refuses_a_request_on_the_real_one() -> None:
    clock = VirtualClock()
    request = Request(idempotent=True, timeout=1.0)  # time.monotonic

    def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    # at the first wait, as the async doors check
    with pytest.raises(ValueError, match=r"Request\(clock=<the same clock>\.clock\)"):
        RetryOrchestrator(sleep=clock.sleep).execute_sync(request, send)
    assert clock.sleeps == []


def test_execute_sync_given_a_virtual_sleep_refuses_a_request_on_the_real_clock() -> None:
    """``execute_sync(..., sleep=clock.sleep_sync)`` (what VirtualClock's docstring shows)
    with a request on the real clock: the orchestrator's check never ran for a sleep
    given to the call, and the request "timed out after 10 retries" in no time."""
    clock = VirtualClock()
    request = Request(idempotent=True, timeout=0.3)  # time.monotonic
    sent: list[int] = []

    def send(_: Request) -> None:
        sent.append(1)
        raise RetryableError(RetryReason.KV_LOCKED)

    with pytest.raises(ValueError, match=r"Request\(clock=<the same clock>\.clock\)"):
        RetryOrchestrator().execute_sync(request, send, sleep=clock.sleep_sync)
    assert clock.sleeps == []
    assert sent == [1]  # refused at the first wait


def test_execute_sync_refuses_to_wait_in_real_time_for_a_request_on_a_virtual_clock() -> None:
    """The other way round: it retried until the end of real time (the request's virtual
    deadline never came)."""
    clock = VirtualClock()
    request = Request(idempotent=True, timeout=0.3, clock=clock.clock)

    def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    with pytest.raises(ValueError, match=r"sleep=<the clock>\.sleep_sync"):
        RetryOrchestrator().execute_sync(request, send)
    # on its own clock, as documented: the deadline comes
    again = Request(idempotent=True, timeout=0.3, clock=clock.clock)
    with pytest.raises(UnambiguousTimeoutException):
        RetryOrchestrator().execute_sync(again, send, sleep=clock.sleep_sync)


def test_execute_sync_names_a_virtual_clock_without_a_blocking_sleep() -> None:
    class AsyncOnly:
        now = 0.0

        def clock(self) -> float:
            return self.now

        async def sleep(self, seconds: float) -> None:
            self.now += seconds

    def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    clock = AsyncOnly()
    request = Request(idempotent=True, timeout=1.0, clock=clock.clock)
    with pytest.raises(ValueError, match="its clock has no sleep_sync"):
        RetryOrchestrator(sleep=clock.sleep).execute_sync(request, send)
    # a request that needs no wait runs as before
    assert RetryOrchestrator(sleep=clock.sleep).execute_sync(Request(), lambda _: 42) == 42


async def test_fail_books_the_effect_the_caller_knows() -> None:
    # A replace answered "not found": the server proves nothing was applied.
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.replace", idempotent=False)
    with orchestrator.attempt(request):
        pass  # the attempt went out and came back with the answer below
    error = orchestrator.fail(request, KeyError("not found"), effect=AttemptEffect.NOT_APPLIED)
    assert isinstance(error, KeyError)
    assert not request.maybe_applied
    assert request.attempts[-1].effect is AttemptEffect.NOT_APPLIED

    plain = Request(name="kv.replace", idempotent=False)
    orchestrator.fail(plain, KeyError("?"))
    assert plain.maybe_applied  # the default: nothing proves otherwise

    untouched = Request(name="kv.replace")
    with pytest.raises(TypeError, match=r"fail\(effect=\.\.\.\) must be an AttemptEffect"):
        orchestrator.fail(untouched, KeyError("?"), effect="not_applied")  # type: ignore[arg-type]
    assert untouched.state is RequestState.PENDING


@pytest.mark.parametrize("door", ["execute", "hedge", "attempt", "execute_sync"])
async def test_an_expired_request_pays_nothing_into_the_retry_budget(door: str) -> None:
    """Nothing is sent for a request whose deadline passed before its first attempt: no
    door pays a first attempt into the budget (execute_sync did)."""
    clock = VirtualClock()
    problems: list[str] = []
    budget = CountingBudget(RetryBudget(), problems, lambda: None)
    orchestrator = RetryOrchestrator(retry_budget=budget)
    request = Request(name="kv.get", idempotent=True, timeout=1.0, clock=clock.clock)
    clock.advance(2.0)
    sent: list[int] = []

    async def send(request: Request, index: int = 0) -> str:
        sent.append(index)
        return "ok"

    async def run() -> None:
        if door == "execute":
            await orchestrator.execute(request, send)
        elif door == "hedge":
            await orchestrator.hedge(request, send, HedgePolicy(2, delay=0.01))
        elif door == "attempt":
            with orchestrator.attempt(request):
                await send(request)
        else:
            orchestrator.execute_sync(request, lambda r: sent.append(0) or "ok")  # type: ignore[func-returns-value]

    with pytest.raises(UnambiguousTimeoutException):
        await run()
    assert sent == []
    assert budget.deposits == 0
    assert problems == []


@pytest.mark.parametrize("first", ["execute", "hedge"])
async def test_a_request_already_being_sent_is_refused_by_every_door(first: str) -> None:
    """One Request handed to two calls at once: the second is refused before it sends
    anything (both sent a write of the same request, and the loser was told it was
    cancelled with nothing about its own attempt). The first call and the request go on.
    A hedge's copies in flight mark the request neither in flight nor with a history:
    the door's own mark does."""
    import anyio

    entered = anyio.Event()
    release = anyio.Event()
    writes: list[str] = []

    async def first_send(request: Request, index: int = 0) -> str:
        writes.append("first")
        entered.set()
        await release.wait()
        return "done"

    async def second_send(request: Request, index: int = 0) -> str:
        writes.append("second")
        return "done"

    orchestrator = RetryOrchestrator()
    request = Request(name="kv.replace", idempotent=True, timeout=5.0)
    results: list[str] = []

    async def hand_wired() -> None:
        with orchestrator.attempt(request):
            await second_send(request)

    async def run_first() -> None:
        if first == "execute":
            results.append(await orchestrator.execute(request, first_send))
        else:
            policy = HedgePolicy(1, delay=1.0)
            results.append(await orchestrator.hedge(request, first_send, policy))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_first)
            await entered.wait()
            with pytest.raises(RuntimeError, match=r"already being sent by another call"):
                await orchestrator.execute(request, second_send)
            with pytest.raises(RuntimeError, match=r"already being sent by another call"):
                await orchestrator.hedge(request, second_send, HedgePolicy(2, delay=0.01))
            with pytest.raises(RuntimeError, match=r"already being sent by another call"):
                orchestrator.execute_sync(request, lambda r: writes.append("sync") or "x")  # type: ignore[func-returns-value]
            with pytest.raises(RuntimeError, match=r"already being sent by another call"):
                await hand_wired()
            assert request.state is RequestState.PENDING  # left as it was
            release.set()
    assert writes == ["first"]
    assert results == ["done"]
    assert request.state is RequestState.SUCCEEDED


async def test_a_second_attempt_block_on_a_request_in_flight_is_refused() -> None:
    """Two hand-wired ``attempt()`` blocks on one request at once would send a write
    twice: the second is refused before anything is sent, the first goes on. (One after
    another, a block whose failure was never booked, stays allowed: a loop that reconnects
    on a refused connection without asking maybe_retry.)"""
    entered = anyio.Event()
    release = anyio.Event()
    writes: list[str] = []
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)

    async def first() -> None:
        with orchestrator.attempt(request):
            writes.append("first")
            entered.set()
            await release.wait()
        orchestrator.succeed(request)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await entered.wait()
            with (
                pytest.raises(RuntimeError, match=r"an attempt\(\) block still open"),
                orchestrator.attempt(request),
            ):
                writes.append("second")
            with pytest.raises(RuntimeError, match=r"already being sent"):
                await orchestrator.execute(request, lambda r: anyio.sleep(0.001))
            assert request.state is RequestState.PENDING
            assert request.in_flight
            release.set()
    assert writes == ["first"]
    assert request.state is RequestState.SUCCEEDED
    again = Request(name="kv.get", idempotent=True, timeout=5.0)
    for _ in range(2):  # ended unbooked (the loop reconnects by itself): not refused
        with orchestrator.attempt(again):
            pass
    orchestrator.succeed(again)


async def test_maybe_retry_inside_a_doors_send_is_refused() -> None:
    """``maybe_retry`` called from inside ``execute``'s (or ``hedge``'s) ``send`` would
    book a second retry for one failure: refused, and the door's own loop goes on."""
    orchestrator = RetryOrchestrator()
    seen: list[str] = []

    async def send(request: Request, index: int = 0) -> str:
        if request.failed_attempts == 0:
            with pytest.raises(RuntimeError, match=r"raise a RetryableError from send"):
                await orchestrator.maybe_retry(request, RetryReason.KV_LOCKED)
            seen.append("refused")
            raise RetryableError(RetryReason.KV_LOCKED)
        return "ok"

    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    assert await orchestrator.execute(request, send) == "ok"
    assert (request.retry_attempts, request.failed_attempts) == (1, 1)
    hedged = Request(name="kv.get", idempotent=True, timeout=5.0)
    assert await orchestrator.hedge(hedged, send, HedgePolicy(2, delay=1.0)) == "ok"
    assert seen == ["refused", "refused"]
    assert hedged.failed_attempts == 1


async def test_maybe_retry_refuses_a_retryable_cause_of_another_reason() -> None:
    """``maybe_retry(request, KV_LOCKED, cause=RetryableError(SOCKET_CLOSED_WHILE_IN_FLIGHT))``
    booked the write under KV_LOCKED's effect (not applied) and retried it, though the
    socket closed after it was sent: refused, the request left as it was."""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)
    cause = RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, "reset after the write")
    with pytest.raises(ValueError, match=r"KV_LOCKED.*SOCKET_CLOSED_WHILE_IN_FLIGHT.*exc\.reason"):
        await orchestrator.maybe_retry(request, RetryReason.KV_LOCKED, cause=cause)
    assert (request.state, request.failed_attempts, request.retry_attempts) == (
        RequestState.PENDING,
        0,
        0,
    )
    # With its own reason, the write is not sent again.
    with pytest.raises(RequestCanceledException, match="may have been applied"):
        await orchestrator.maybe_retry(request, cause.reason, cause=cause)
    assert request.maybe_applied
    assert request.retry_attempts == 0


async def test_a_loop_that_catches_sdkcores_own_timeout_gets_it_back() -> None:
    """sdkcore's timeouts are builtin TimeoutErrors: a loop mapping ``TimeoutError`` to a
    retryable reason catches ``attempt()``'s own timeout and hands it to ``maybe_retry``,
    which said "request was cancelled" and lost "it may have been applied". It raises
    the timeout again; asked later without it, a timed-out request says it timed out."""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=0.05)
    caught: list[BaseException] = []

    async def dispatch() -> None:
        try:
            with orchestrator.attempt(request):
                await anyio.sleep(5)  # the write is out when the deadline passes
        except (ConnectionError, TimeoutError) as exc:  # the README's failure table
            caught.append(exc)
            await orchestrator.maybe_retry(
                request, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, cause=exc
            )

    with pytest.raises(AmbiguousTimeoutException) as info:
        await dispatch()
    assert info.value is caught[0]
    assert "may have been applied" in str(info.value)
    with pytest.raises(AmbiguousTimeoutException, match=r"timed out already.*may have been"):
        await orchestrator.maybe_retry(request, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
    with (
        pytest.raises(AmbiguousTimeoutException, match="timed out already"),
        orchestrator.attempt(request),
    ):
        raise AssertionError("sent after its timeout")


class _NotFound(CouchbaseException):
    pass


@pytest.mark.parametrize("door", ["execute", "execute_sync", "hedge"])
async def test_a_couchbase_exception_send_raised_gets_the_requests_context(door: str) -> None:
    """README, "When things fail": a ``CouchbaseException`` ``send`` raised as the final
    answer gets the request's context (every attempt, its id), a mapper's ``extra`` kept.
    ``execute_sync`` and ``hedge`` raised it without one."""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.get", idempotent=True, timeout=5)
    failures = [RetryableError(TEMP, "busy"), None]

    def answer(_: Request) -> str:
        failure = failures.pop(0)
        if failure is not None:
            raise failure
        error = _NotFound("no such document")
        error.context = request.error_context(None, extra={"bucket": "b1"})  # the mapper's
        raise error

    async def send(r: Request) -> str:
        return answer(r)

    async def copy(r: Request, index: int) -> str:
        return answer(r)

    async def run() -> str:
        if door == "execute":
            return await orchestrator.execute(request, send)
        if door == "execute_sync":
            return orchestrator.execute_sync(request, answer)
        return await orchestrator.hedge(request, copy, HedgePolicy(2, delay=0.0))

    with pytest.raises(_NotFound) as info:
        await run()
    context = info.value.context
    assert context is not None
    assert context.request_id == request.id
    assert context.extra["bucket"] == "b1"
    assert [a.reason for a in context.attempts][:1] == [TEMP]
    assert len(context.attempts) == 2  # the final answer's attempt included


@pytest.mark.parametrize("door", ["execute", "execute_sync", "hedge", "fail"])
async def test_a_final_answer_that_proves_nothing_changed_is_booked_so(door: str) -> None:
    """A CouchbaseException's ``effect`` (the KV mapper's NOT_APPLIED for an ADD answered
    "exists") is how every door books the final attempt: the context said maybe applied
    for a refused write. (A hedged request is idempotent: hedging refuses the others.)"""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.insert", idempotent=door == "hedge", timeout=5)

    def answer(_: Request) -> str:
        error = _NotFound("already exists")
        error.effect = AttemptEffect.NOT_APPLIED
        raise error

    async def send(r: Request) -> str:
        return answer(r)

    async def copy(r: Request, index: int) -> str:
        return answer(r)

    async def by_hand() -> str:
        try:
            with orchestrator.attempt(request):
                return answer(request)
        except _NotFound as exc:
            raise orchestrator.fail(request, exc) from None  # no effect= given: the error's

    async def run() -> str:
        if door == "execute":
            return await orchestrator.execute(request, send)
        if door == "execute_sync":
            return orchestrator.execute_sync(request, answer)
        if door == "hedge":
            return await orchestrator.hedge(request, copy, HedgePolicy(2, delay=0.05))
        return await by_hand()

    with pytest.raises(_NotFound):
        await run()
    assert [a.effect for a in request.attempts] == [AttemptEffect.NOT_APPLIED]
    assert not request.maybe_applied


async def test_an_inner_requests_answer_proves_nothing_of_the_outer_attempt() -> None:
    """An inner request's final answer that the outer send lets through carries the inner's
    context: its NOT_APPLIED is about the inner's command, and the outer attempt, which may
    have written other things, stays maybe applied."""
    orchestrator = RetryOrchestrator()
    inner = Request(name="kv.insert", idempotent=False, timeout=5)

    async def inner_send(r: Request) -> str:
        error = _NotFound("already exists")
        error.effect = AttemptEffect.NOT_APPLIED
        raise error

    async def outer_send(r: Request) -> str:
        return await orchestrator.execute(inner, inner_send)  # (after writes of its own)

    outer = Request(name="checkout", idempotent=False, timeout=5)
    with pytest.raises(_NotFound):
        await orchestrator.execute(outer, outer_send)
    assert [a.effect for a in inner.attempts] == [AttemptEffect.NOT_APPLIED]
    assert [a.effect for a in outer.attempts] == [AttemptEffect.MAYBE_APPLIED]
    assert outer.maybe_applied


@pytest.mark.parametrize("door", ["execute", "maybe_retry"])
async def test_a_retryable_failure_at_the_deadline_times_out_as_on_execute_sync(door: str) -> None:
    """``send`` fails with a retryable reason once the request's clock is past its deadline
    (a virtual clock here; a real answer can come in the deadline's own turn): the timeout
    at once, the strategy not asked and no retry booked or logged, on every door.
    ``execute`` and ``maybe_retry`` booked a capped retry and logged ``retry.scheduled``
    ("after 1 retry ... the last retry was due past the deadline, not sent")."""

    def run_sync() -> tuple[Request, BaseException, list[str]]:
        clock = VirtualClock()
        request = Request(idempotent=True, timeout=1.0, clock=clock.clock)

        def send(_: Request) -> str:
            clock.advance(2.0)
            raise RetryableError(RetryReason.KV_LOCKED)

        with capture_retry_events() as events, pytest.raises(TimeoutException) as info:
            RetryOrchestrator(sleep=clock.sleep).execute_sync(request, send, sleep=clock.sleep_sync)
        return request, info.value, [e["event"] for e in events]

    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request = Request(idempotent=True, timeout=1.0, clock=clock.clock)

    async def send(_: Request) -> str:
        clock.advance(2.0)
        raise RetryableError(RetryReason.KV_LOCKED)

    async def run() -> None:
        if door == "execute":
            await orch.execute(request, send)
        else:
            with orch.attempt(request):
                pass
            clock.advance(2.0)
            await orch.maybe_retry(request, RetryReason.KV_LOCKED)

    with capture_retry_events() as events, pytest.raises(TimeoutException) as info:
        await run()
    sync_request, sync_error, sync_events = run_sync()
    assert sync_events == ["retry.timed_out"]
    assert [e["event"] for e in events] == sync_events
    assert request.retry_attempts == sync_request.retry_attempts == 0
    assert str(info.value).split(" {")[0] == str(sync_error).split(" {")[0]
    assert "after 0 retries (last: KV_LOCKED)" in str(info.value)


@pytest.mark.parametrize("door", ["execute", "maybe_retry"])
async def test_the_async_doors_refuse_to_wait_in_real_time_for_a_virtual_deadline(
    door: str,
) -> None:
    """As ``execute_sync`` refuses it: a request on a VirtualClock, an orchestrator waiting on
    the event loop's clock. It backed off in real time, retried while called, and its
    deadline never came."""
    clock = VirtualClock()
    orch = RetryOrchestrator()  # no sleep=clock.sleep
    request = Request(idempotent=True, timeout=1.0, clock=clock.clock)
    sent: list[int] = []

    async def send(_: Request) -> str:
        sent.append(1)
        raise RetryableError(RetryReason.KV_LOCKED)

    async def run() -> None:
        if door == "execute":
            await orch.execute(request, send)
        else:
            await orch.maybe_retry(request, RetryReason.KV_LOCKED)

    with pytest.raises(ValueError, match=r"RetryOrchestrator\(sleep=<the clock>\.sleep\)"):
        await run()
    assert request.state is RequestState.FAILED
    assert request.retry_attempts == 0
    assert len(sent) == (1 if door == "execute" else 0)
    # with the clock's sleep, the deadline comes
    again = Request(idempotent=True, timeout=1.0, clock=clock.clock)
    with pytest.raises(UnambiguousTimeoutException):
        await RetryOrchestrator(sleep=clock.sleep).execute(again, send)
