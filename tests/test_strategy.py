"""Built-in strategies, subclassing, user strategies and overriding the default."""

from __future__ import annotations

import sys
import types
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from sdkcore import (
    AttemptEffect,
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    CancellationReason,
    CollectionNotFoundException,
    CouchbaseException,
    DocumentLockedException,
    ErrorContext,
    FailFastRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
    ScopeNotFoundException,
)
from sdkcore.testing import VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio

ALWAYS = [r for r in RetryReason if r.always_retry]
NOT_ALWAYS = [r for r in RetryReason if not r.always_retry]


def ms(n: float) -> timedelta:
    return timedelta(milliseconds=n)


async def request_with_attempts(n: int, *, idempotent: bool = False) -> Request:
    """A real Request whose retry_attempts is n (bumped through an orchestrator)."""
    vc = VirtualClock()
    orch = RetryOrchestrator(FailFastRetryStrategy(), sleep=vc.sleep)
    req = Request(idempotent=idempotent, timeout=None, clock=vc.clock)
    for _ in range(n):
        await orch.maybe_retry(req, RetryReason.KV_NOT_MY_VBUCKET)
    assert req.retry_attempts == n
    return req


def built(action: RetryAction) -> type[BaseException] | None:
    """The exception class a refusal produces (None for the default or a retry)."""
    if action.exception is None:
        return None
    ctx = ErrorContext(
        request_id=1,
        request_name="r",
        idempotent=False,
        retry_attempts=0,
        retry_reasons=(),
        timeout=None,
        elapsed=timedelta(0),
    )
    return type(action.exception(ctx))


class Recording:
    """A strategy that records its calls and retries after 1 ms."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, RetryReason]] = []

    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        self.calls.append((request.id, reason))
        return RetryAction.with_duration(ms(1))


def virtual(strategy: Any = None, **kwargs: Any) -> tuple[RetryOrchestrator, VirtualClock]:
    vc = VirtualClock()
    return RetryOrchestrator(strategy, sleep=vc.sleep, **kwargs), vc


# -- BestEffortRetryStrategy --------------------------------------------------------


async def test_best_effort_default_sequence() -> None:
    strategy = BestEffortRetryStrategy()
    expected = [1, 2, 4, 8, 16, 32, 64, 128, 256, 500, 500, 500]
    req = await request_with_attempts(0, idempotent=True)
    vc = VirtualClock()
    orch = RetryOrchestrator(FailFastRetryStrategy(), sleep=vc.sleep)
    got = []
    for n in range(len(expected)):
        assert req.retry_attempts == n
        got.append((await strategy.retry_after(req, RetryReason.UNKNOWN)).duration)
        await orch.maybe_retry(req, RetryReason.KV_NOT_MY_VBUCKET)
    assert got == [ms(x) for x in expected]


async def test_best_effort_default_stays_at_500ms_far_out() -> None:
    req = await request_with_attempts(200)
    action = await BestEffortRetryStrategy().retry_after(req, RetryReason.KV_LOCKED)
    assert action.duration == ms(500)


async def test_best_effort_custom_backoff_timedelta() -> None:
    seen: list[int] = []

    def backoff(attempt: int) -> timedelta:
        seen.append(attempt)
        return ms(7 * (attempt + 1))

    strategy = BestEffortRetryStrategy(backoff)
    assert (
        await strategy.retry_after(await request_with_attempts(0), RetryReason.KV_LOCKED)
    ).duration == ms(7)
    assert (
        await strategy.retry_after(await request_with_attempts(3), RetryReason.KV_LOCKED)
    ).duration == ms(28)
    assert seen == [0, 3]
    assert strategy.backoff is backoff


async def test_best_effort_custom_backoff_float_seconds() -> None:
    strategy = BestEffortRetryStrategy(backoff=lambda attempt: 0.25 * (attempt + 1))
    action = await strategy.retry_after(await request_with_attempts(1), RetryReason.KV_LOCKED)
    assert isinstance(action.duration, timedelta)
    assert action.duration == ms(500)


async def test_best_effort_custom_backoff_bad_value_is_a_clear_error() -> None:
    strategy = BestEffortRetryStrategy(backoff=lambda attempt: "soon")  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="timedelta"):
        await strategy.retry_after(Request(), RetryReason.KV_LOCKED)


def test_best_effort_rejects_non_callable_backoff() -> None:
    with pytest.raises(TypeError, match=r"backoff=.*callable"):
        BestEffortRetryStrategy(backoff=0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("reason", [r for r in RetryReason if not r.allows_non_idempotent_retry])
async def test_best_effort_no_retry_for_non_idempotent_when_reason_disallows(
    reason: RetryReason,
) -> None:
    action = await BestEffortRetryStrategy().retry_after(Request(idempotent=False), reason)
    assert action.duration is None
    assert action.retries is False


@pytest.mark.parametrize("reason", list(RetryReason))
async def test_best_effort_retries_idempotent_for_every_reason(reason: RetryReason) -> None:
    action = await BestEffortRetryStrategy().retry_after(Request(idempotent=True), reason)
    assert action.duration == ms(1)


@pytest.mark.parametrize("reason", [r for r in RetryReason if r.allows_non_idempotent_retry])
async def test_best_effort_retries_non_idempotent_when_reason_allows(reason: RetryReason) -> None:
    action = await BestEffortRetryStrategy().retry_after(Request(idempotent=False), reason)
    assert action.duration == ms(1)


# -- FastFailOnTerminalErrorRetryStrategy ------------------------------------------

# The RFC's mapping, in the RFC's order.
FAST_FAIL = [
    (RetryReason.AUTHENTICATION_ERROR, AuthenticationFailureException),
    (RetryReason.TLS_ERROR, CouchbaseException),
    (RetryReason.BUCKET_ACCESS_ERROR, CouchbaseException),
    (RetryReason.SCOPE_NOT_FOUND, ScopeNotFoundException),
    (RetryReason.COLLECTION_NOT_FOUND, CollectionNotFoundException),
]
TERMINAL = {r for r, _ in FAST_FAIL}


@pytest.mark.parametrize("idempotent", [False, True])
@pytest.mark.parametrize(("reason", "exc"), FAST_FAIL, ids=[r.name for r, _ in FAST_FAIL])
async def test_fast_fail_mapping(
    reason: RetryReason, exc: type[CouchbaseException], idempotent: bool
) -> None:
    action = await FastFailOnTerminalErrorRetryStrategy().retry_after(
        Request(idempotent=idempotent), reason
    )
    assert action.duration is None
    assert built(action) is exc


@pytest.mark.parametrize(("reason", "exc"), FAST_FAIL, ids=[r.name for r, _ in FAST_FAIL])
async def test_fast_fail_raises_the_mapped_exception_through_the_orchestrator(
    reason: RetryReason, exc: type[CouchbaseException]
) -> None:
    orch, vc = virtual()  # the default strategy
    req = Request(idempotent=True, clock=vc.clock)
    with pytest.raises(CouchbaseException) as info:
        await orch.maybe_retry(req, reason)
    assert type(info.value) is exc
    assert info.value.context is not None
    assert info.value.context.reason is reason
    assert info.value.context.request_id == req.id
    assert req.retry_attempts == 0
    assert req.completed
    assert vc.sleeps == []


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        (RetryReason.TLS_ERROR, ("TLS error", "RetryReason.TLS_ERROR", "certificates")),
        (RetryReason.BUCKET_ACCESS_ERROR, ("bucket access error", "BUCKET_ACCESS_ERROR")),
    ],
)
async def test_fast_fail_names_the_problem_it_did_not_retry(
    reason: RetryReason, words: tuple[str, ...]
) -> None:
    """RFC 0049 wants "immediate clear feedback on basic problems": the CouchbaseException
    a TLS or bucket-access failure ends with says which problem it was (its default
    message, "operation failed", named nothing)."""
    orch, vc = virtual()
    with pytest.raises(CouchbaseException) as info:
        await orch.maybe_retry(Request(idempotent=True, clock=vc.clock), reason)
    assert type(info.value) is CouchbaseException
    for word in words:
        assert word in info.value.message


def test_fast_fail_mapping_covers_exactly_the_terminal_reasons() -> None:
    # Order is the RFC's; every terminal reason maps to exactly one exception.
    assert [r.name for r, _ in FAST_FAIL] == [
        "AUTHENTICATION_ERROR",
        "TLS_ERROR",
        "BUCKET_ACCESS_ERROR",
        "SCOPE_NOT_FOUND",
        "COLLECTION_NOT_FOUND",
    ]


@pytest.mark.parametrize("attempts", [0, 1, 4, 9, 30])
@pytest.mark.parametrize("idempotent", [False, True])
async def test_fast_fail_is_best_effort_for_every_other_reason(
    attempts: int, idempotent: bool
) -> None:
    req = await request_with_attempts(attempts, idempotent=idempotent)
    custom = lambda n: ms(3 * n + 2)  # noqa: E731
    pairs = [
        (FastFailOnTerminalErrorRetryStrategy(), BestEffortRetryStrategy()),
        (FastFailOnTerminalErrorRetryStrategy(custom), BestEffortRetryStrategy(custom)),
    ]
    for fast, best in pairs:
        for reason in RetryReason:
            if reason in TERMINAL:
                continue
            a = await fast.retry_after(req, reason)
            b = await best.retry_after(req, reason)
            assert a.duration == b.duration, reason
            assert a.exception is None, reason
            assert b.exception is None, reason


def test_fast_fail_is_a_best_effort_subclass() -> None:
    assert issubclass(FastFailOnTerminalErrorRetryStrategy, BestEffortRetryStrategy)


# -- FailFastRetryStrategy -----------------------------------------------------------


@pytest.mark.parametrize("idempotent", [False, True])
async def test_fail_fast_never_retries(idempotent: bool) -> None:
    for reason in RetryReason:
        action = await FailFastRetryStrategy().retry_after(Request(idempotent=idempotent), reason)
        assert action.duration is None, reason


@pytest.mark.parametrize("reason", ALWAYS, ids=lambda r: r.name)
async def test_fail_fast_still_retries_always_retry_reasons_with_controlled_backoff(
    reason: RetryReason,
) -> None:
    orch, vc = virtual(FailFastRetryStrategy())
    req = Request(timeout=None, clock=vc.clock)
    waited = [await orch.maybe_retry(req, reason) for _ in range(7)]
    assert waited == [ms(x) for x in (1, 10, 50, 100, 500, 1000, 1000)]
    assert vc.sleeps == pytest.approx([0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 1.0])
    assert req.retry_attempts == 7
    assert req.retry_reasons == (reason,)
    with pytest.raises(RequestCanceledException):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)


@pytest.mark.parametrize("idempotent", [False, True])
async def test_always_retry_does_not_consult_the_strategy(idempotent: bool) -> None:
    strategy = Recording()
    orch, vc = virtual(strategy)
    req = Request(idempotent=idempotent, timeout=None, clock=vc.clock)
    for reason in ALWAYS:
        await orch.maybe_retry(req, reason)
    assert strategy.calls == []
    await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert strategy.calls == [(req.id, RetryReason.KV_LOCKED)]
    # Controlled backoff continues from the attempt count, whatever the reasons were.
    assert await orch.maybe_retry(req, RetryReason.KV_COLLECTION_OUTDATED) == ms(500)
    assert len(strategy.calls) == 1


# -- overriding the default ---------------------------------------------------------


def test_default_strategy_is_fast_fail_on_terminal_error() -> None:
    assert type(RetryOrchestrator().default_strategy) is FastFailOnTerminalErrorRetryStrategy


async def test_per_orchestrator_override() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(clock=vc.clock)
    assert await orch.maybe_retry(req, RetryReason.AUTHENTICATION_ERROR) == ms(1)
    assert isinstance(orch.default_strategy, BestEffortRetryStrategy)


async def test_per_request_override_beats_the_orchestrator_default() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    strict = Request(idempotent=True, retry_strategy=FailFastRetryStrategy(), clock=vc.clock)
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(strict, RetryReason.KV_LOCKED)
    assert info.value.context is not None
    assert info.value.context.strategy == "FailFastRetryStrategy"
    relaxed = Request(retry_strategy=BestEffortRetryStrategy(), clock=vc.clock)
    default_orch, _ = virtual()  # FastFail default
    assert await default_orch.maybe_retry(relaxed, RetryReason.AUTHENTICATION_ERROR) == ms(1)
    # The request without an override uses the (fast-fail) default.
    with pytest.raises(AuthenticationFailureException):
        await default_orch.maybe_retry(Request(clock=vc.clock), RetryReason.AUTHENTICATION_ERROR)


@pytest.mark.parametrize("bad", [object(), BestEffortRetryStrategy, "best-effort"])
def test_orchestrator_rejects_a_default_that_is_not_a_strategy_instance(bad: object) -> None:
    with pytest.raises(TypeError, match=r"default_strategy"):
        RetryOrchestrator(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "kind"),
    [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError), ("10", TypeError)],
)
def test_orchestrator_rejects_bad_max_requests_in_retry(bad: object, kind: type) -> None:
    # the wrong type is a TypeError, a number out of range a ValueError
    with pytest.raises(kind, match=r"max_requests_in_retry.*>= 1"):
        RetryOrchestrator(max_requests_in_retry=bad)  # type: ignore[arg-type]


# -- subclassing ------------------------------------------------------------------


class RobotAwareStrategy(BestEffortRetryStrategy):
    """The RFC's example: do not retry requests that come from robots."""

    def __init__(self) -> None:
        super().__init__()
        self.delegated = 0

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.client_context.get("isRobotRequest"):
            return RetryAction.no_retry()
        self.delegated += 1
        return await super().retry_after(request, reason)


async def test_subclass_robot_request_is_not_retried() -> None:
    strategy = RobotAwareStrategy()
    orch, vc = virtual(strategy)
    robot = Request(idempotent=True, client_context={"isRobotRequest": True}, clock=vc.clock)
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(robot, RetryReason.KV_TEMPORARY_FAILURE)
    assert info.value.context is not None
    assert info.value.context.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    assert info.value.context.strategy == "RobotAwareStrategy"
    assert strategy.delegated == 0


async def test_subclass_falls_back_to_best_effort() -> None:
    strategy = RobotAwareStrategy()
    orch, vc = virtual(strategy)
    human = Request(idempotent=False, client_context={"user": "ana"}, clock=vc.clock, timeout=None)
    assert await orch.maybe_retry(human, RetryReason.KV_TEMPORARY_FAILURE) == ms(1)
    assert await orch.maybe_retry(human, RetryReason.KV_TEMPORARY_FAILURE) == ms(2)
    assert strategy.delegated == 2
    # ... including BestEffort's refusal for a non-idempotent request and an unsafe reason.
    with pytest.raises(RequestCanceledException):
        await orch.maybe_retry(human, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
    assert strategy.delegated == 3


async def test_subclass_of_fast_fail_keeps_the_terminal_mapping() -> None:
    class Longer(FastFailOnTerminalErrorRetryStrategy):
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            action = await super().retry_after(request, reason)
            if action.duration is None:
                return action
            return RetryAction.with_duration(action.duration * 10)

    orch, vc = virtual(Longer())
    req = Request(timeout=None, clock=vc.clock)
    assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == ms(10)
    with pytest.raises(ScopeNotFoundException):
        await orch.maybe_retry(req, RetryReason.SCOPE_NOT_FOUND)


# -- user strategies --------------------------------------------------------------


class SyncStrategy:
    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        return RetryAction.with_duration(0.003)


class AsyncStrategy:
    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        await anyio.lowlevel.checkpoint()
        return RetryAction.with_duration(timedelta(milliseconds=4))


class ReturnsAwaitable:
    """A plain method that hands back an awaitable (e.g. a wrapped coroutine)."""

    def retry_after(self, request: Request, reason: RetryReason) -> Awaitable[RetryAction]:
        return self._decide(request, reason)

    async def _decide(self, request: Request, reason: RetryReason) -> RetryAction:
        await anyio.lowlevel.checkpoint()
        return RetryAction.with_duration(0.005)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [(SyncStrategy(), ms(3)), (AsyncStrategy(), ms(4)), (ReturnsAwaitable(), ms(5))],
    ids=["sync", "async", "returns-awaitable"],
)
async def test_user_strategy_kinds(strategy: Any, expected: timedelta) -> None:
    assert isinstance(strategy, RetryStrategy)
    orch, vc = virtual(strategy)
    req = Request(timeout=None, clock=vc.clock)
    for n in range(3):  # the kind is decided once; later attempts go the same way
        assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == expected
        assert req.retry_attempts == n + 1
    # per-request too
    other, _ = virtual(FailFastRetryStrategy())
    req2 = Request(timeout=None, clock=vc.clock, retry_strategy=strategy)
    assert await other.maybe_retry(req2, RetryReason.KV_LOCKED) == expected


async def test_plain_objects_with_a_retry_after_attribute() -> None:
    async def async_decide(request: Request, reason: RetryReason) -> RetryAction:
        await anyio.lowlevel.checkpoint()
        return RetryAction.with_duration(0.002)

    sync_obj = types.SimpleNamespace(
        retry_after=lambda request, reason: RetryAction.with_duration(0.001)
    )
    async_obj = types.SimpleNamespace(retry_after=async_decide)
    refuse_obj = types.SimpleNamespace(retry_after=lambda request, reason: RetryAction.no_retry())
    orch, vc = virtual()
    for obj, expected in ((sync_obj, ms(1)), (async_obj, ms(2)), (sync_obj, ms(1))):
        req = Request(clock=vc.clock, retry_strategy=obj)
        assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == expected
    with pytest.raises(RequestCanceledException):
        await orch.maybe_retry(
            Request(clock=vc.clock, retry_strategy=refuse_obj), RetryReason.KV_LOCKED
        )


async def test_async_strategy_awaiting_io() -> None:
    """retry_after may wait on I/O: here, a decision sent by another task over a stream."""
    send, receive = anyio.create_memory_object_stream[RetryAction](1)

    class Remote:
        def __init__(self) -> None:
            self.asked = 0

        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            self.asked += 1
            await anyio.lowlevel.checkpoint()
            return await receive.receive()

    strategy = Remote()
    orch, vc = virtual(strategy)
    req = Request(timeout=None, clock=vc.clock)
    result: list[timedelta] = []

    async def caller() -> None:
        result.append(await orch.maybe_retry(req, RetryReason.KV_LOCKED))

    async with send, receive, anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        assert strategy.asked == 1
        assert result == []  # still waiting for the decision
        assert req.retry_attempts == 0
        await send.send(RetryAction.with_duration(0.042))
    assert result == [ms(42)]
    assert req.retry_attempts == 1
    assert vc.sleeps == pytest.approx([0.042])


class Boom(Exception):
    pass


class RaisingSync:
    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        raise Boom("strategy backend down")


class RaisingAsync:
    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        await anyio.lowlevel.checkpoint()
        raise Boom("strategy backend down")


@pytest.mark.parametrize("strategy", [RaisingSync(), RaisingAsync()], ids=["sync", "async"])
async def test_strategy_that_raises_fails_the_request_with_that_exception(strategy: Any) -> None:
    orch, vc = virtual(strategy)
    req = Request(timeout=None, clock=vc.clock)
    await orch.maybe_retry(req, RetryReason.KV_NOT_MY_VBUCKET)  # always-retry: not consulted
    with pytest.raises(Boom, match="strategy backend down"):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert req.retry_attempts == 1
    assert req.retry_reasons == (RetryReason.KV_NOT_MY_VBUCKET,)
    assert req.state is RequestState.FAILED
    assert len(vc.sleeps) == 1  # no wait after the failure


class Garbage:
    def __init__(self, value: object) -> None:
        self.value = value

    def retry_after(self, request: Request, reason: RetryReason) -> Any:
        return self.value


class AsyncGarbage:
    async def retry_after(self, request: Request, reason: RetryReason) -> Any:
        return timedelta(seconds=1)


@pytest.mark.parametrize(
    "strategy",
    [Garbage(None), Garbage(0.5), Garbage(timedelta(seconds=1)), Garbage("retry"), AsyncGarbage()],
    ids=["none", "float", "timedelta", "str", "async-timedelta"],
)
async def test_strategy_returning_garbage_is_a_clear_type_error(strategy: Any) -> None:
    orch, vc = virtual(strategy)
    req = Request(clock=vc.clock)
    with pytest.raises(TypeError) as info:
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    message = str(info.value)
    assert type(strategy).__name__ in message
    assert "RetryAction" in message
    assert req.retry_attempts == 0
    assert req.completed
    assert vc.sleeps == []


class _EmptyTable(BestEffortRetryStrategy):
    """A strategy that is falsy (an empty table of reasons it retries): it refuses all."""

    def __len__(self) -> int:
        return 0

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        return RetryAction.no_retry()


async def test_a_falsy_strategy_is_still_the_requests_strategy() -> None:
    """``request.retry_strategy or default`` replaced a falsy strategy by the default."""
    sends = 0

    async def send(request: Request) -> str:
        nonlocal sends
        sends += 1
        raise RetryableError(RetryReason.KV_LOCKED)

    vc = VirtualClock()
    orch = RetryOrchestrator(sleep=vc.sleep)
    request = Request(idempotent=True, timeout=10, clock=vc.clock, retry_strategy=_EmptyTable())
    with pytest.raises(RequestCanceledException, match="_EmptyTable"):
        await orch.execute(request, send)
    assert sends == 1

    sync_sends = 0

    def send_sync(request: Request) -> str:
        nonlocal sync_sends
        sync_sends += 1
        raise RetryableError(RetryReason.KV_LOCKED)

    request = Request(idempotent=True, timeout=0.5, retry_strategy=_EmptyTable())
    with pytest.raises(RequestCanceledException, match="_EmptyTable"):
        RetryOrchestrator().execute_sync(request, send_sync)
    assert sync_sends == 1


class _LockedLonger(BestEffortRetryStrategy):
    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        if reason is RetryReason.KV_LOCKED:
            return RetryAction.with_duration(ms(200))
        return super().decide(request, reason)


class _FastFailLockedLonger(FastFailOnTerminalErrorRetryStrategy, _LockedLonger):
    """A mixin after FastFail in the MRO: FastFail's decide must reach it."""


async def test_fast_fail_passes_on_to_the_next_class_in_the_mro() -> None:
    req = await request_with_attempts(0, idempotent=True)
    action = _FastFailLockedLonger().decide(req, RetryReason.KV_LOCKED)
    assert action.duration == ms(200)
    # the terminal reasons are still FastFail's
    assert built(_FastFailLockedLonger().decide(req, RetryReason.AUTHENTICATION_ERROR)) is (
        AuthenticationFailureException
    )


def test_a_refinement_under_a_name_sdkcore_never_calls_is_warned() -> None:
    with pytest.warns(UserWarning, match=r"ShouldRetry\.should_retry\(\) is never called"):

        class ShouldRetry(BestEffortRetryStrategy):
            def should_retry(self, request: Request, reason: RetryReason) -> bool:
                return False

    with pytest.warns(UserWarning, match=r"retryAfter\(\) is never called.*override decide"):

        class JavaSpelling(BestEffortRetryStrategy):
            async def retryAfter(self, request: Request, reason: RetryReason) -> RetryAction:
                return RetryAction.no_retry()


async def test_a_subclass_that_forgot_super_init_is_told_so() -> None:
    class Forgot(BestEffortRetryStrategy):
        def __init__(self) -> None:
            self.extra = 1  # (super().__init__() forgotten)

    strategy = Forgot.__new__(Forgot)
    strategy.__init__()  # type: ignore[misc]
    req = await request_with_attempts(0, idempotent=True)
    with pytest.raises(TypeError, match=r"Forgot\.__init__ did not call super\(\)\.__init__\(\)"):
        strategy.decide(req, RetryReason.KV_LOCKED)
    assert repr(strategy) == "Forgot(<not initialised>)"


def test_a_requests_strategy_cannot_be_changed_and_says_how_to_choose_one() -> None:
    request = Request(name="kv.get", idempotent=True)
    with pytest.raises(AttributeError, match=r"fixed when the request is built.*retry_strategy="):
        request.retry_strategy = FailFastRetryStrategy()
    assert request.retry_strategy is None


class _AppError(Exception):
    pass


class _OwnInit(CouchbaseException):
    def __init__(self, message: str) -> None:  # (no context= keyword)
        super().__init__(message)


@pytest.mark.parametrize(
    ("factory", "expected", "text"),
    [
        (lambda context: _AppError("no robots"), _AppError, "no robots"),
        (_OwnInit, TypeError, r"_OwnInit\), and calling it with the request's ErrorContext raised"),
        (lambda context: 1 / 0, TypeError, r"raised ZeroDivisionError"),
    ],
)
async def test_a_refusals_exception_factory_keeps_the_cause_and_names_its_own_failure(
    factory: Any, expected: type[BaseException], text: str
) -> None:
    """An application exception a factory built kept no __cause__ (only a
    CouchbaseException did); a factory that raised escaped raw, naming neither the
    strategy nor no_retry."""

    class Refuses(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.no_retry(exception=factory)

    failure = RetryableError(RetryReason.KV_LOCKED, "locked")

    async def send(request: Request) -> str:
        raise failure

    request = Request(name="kv.get", idempotent=True, timeout=5, retry_strategy=Refuses())
    with pytest.raises(expected, match=text) as info:
        await RetryOrchestrator().execute(request, send)
    if expected is _AppError:
        assert info.value.__cause__ is failure
    else:
        assert "Refuses.decide" in str(info.value)
        assert info.value.__cause__ is not None


def test_a_helper_called_from_decide_is_not_warned() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Helper(BestEffortRetryStrategy):
            def should_retry(self, request: Request, reason: RetryReason) -> bool:
                return reason is not RetryReason.KV_LOCKED

            def decide(self, request: Request, reason: RetryReason) -> RetryAction:
                if not self.should_retry(request, reason):
                    return RetryAction.no_retry()
                return super().decide(request, reason)

    assert Helper().decide  # type: ignore[truthy-function]  # made without a warning


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
async def test_an_error_the_strategy_raised_says_so_in_a_note() -> None:
    """It propagates unchanged (its type, its traceback); a note under it names the
    strategy and the request, which a bare ZeroDivisionError out of execute did not.
    The doors' own TypeError for a bad answer names the strategy in its message: no note."""

    class Broken(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            return 1 / 0  # type: ignore[return-value]

    class Nonsense(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            return "later"  # type: ignore[return-value]

    async def send(request: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    with pytest.raises(ZeroDivisionError) as info:
        await RetryOrchestrator(Broken()).execute(request, send)
    assert getattr(info.value, "__notes__", None) == [
        f"sdkcore: raised by the retry strategy Broken deciding on request {request.id} "
        "('kv.get') after KV_LOCKED; the request failed"
    ]
    with pytest.raises(TypeError, match=r"Nonsense\.decide") as bad:
        await RetryOrchestrator(Nonsense()).execute(Request(idempotent=True), send)
    assert getattr(bad.value, "__notes__", None) is None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
async def test_a_shared_exception_raised_again_keeps_one_note() -> None:
    shared = ZeroDivisionError("shared")

    class Broken(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            raise shared

    async def send(request: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    orchestrator = RetryOrchestrator(Broken())
    last = None
    for _ in range(3):
        last = Request(name="kv.get", idempotent=True)
        with pytest.raises(ZeroDivisionError):
            await orchestrator.execute(last, send)
    notes = getattr(shared, "__notes__", [])
    assert len(notes) == 1  # not one per request
    assert last is not None
    assert f"request {last.id} " in notes[0]  # the latest


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
async def test_a_write_that_may_have_been_applied_says_so_under_the_strategys_own_error() -> None:
    """The strategy's refusal (its exception) wins over the orchestrator's own for a
    non-idempotent write whose attempt may have been applied (RFC 0049; rfc/0001), and
    a raising strategy's error propagates as is: both said nothing of the write, and
    "document locked" reads as "not applied". A note under each says it may be there."""

    class Translates(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.no_retry(DocumentLockedException)

    class Broken(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            raise KeyError("missing")

    async def send(request: Request) -> None:
        raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)

    write = Request(name="kv.upsert", idempotent=False, retry_strategy=Translates())
    with pytest.raises(DocumentLockedException) as info:
        await RetryOrchestrator().execute(write, send)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1
    assert "not idempotent and may have been applied" in notes[0]
    assert "SOCKET_CLOSED_WHILE_IN_FLIGHT" in notes[0]

    write = Request(name="kv.upsert", idempotent=False, retry_strategy=Broken())
    with pytest.raises(KeyError) as raised:
        await RetryOrchestrator().execute(write, send)
    assert getattr(raised.value, "__notes__", [""])[-1].endswith(
        "the request failed (not idempotent, and an attempt may have been applied)"
    )
    # An idempotent read refused the same way: nothing to say.
    read = Request(name="kv.get", idempotent=True, retry_strategy=Translates())
    with pytest.raises(DocumentLockedException) as plain:
        await RetryOrchestrator().execute(read, send)
    assert getattr(plain.value, "__notes__", None) is None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
async def test_a_shared_refusal_exception_keeps_one_may_have_been_applied_note() -> None:
    shared = DocumentLockedException("locked")

    class Translates(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.no_retry(lambda context: shared)

    async def send(request: Request) -> None:
        raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)

    last = None
    for _ in range(3):
        last = Request(name="kv.upsert", idempotent=False, retry_strategy=Translates())
        with pytest.raises(DocumentLockedException):
            await RetryOrchestrator().execute(last, send)
    notes = getattr(shared, "__notes__", [])
    assert len(notes) == 1
    assert "may have been applied" in notes[0]


@pytest.mark.parametrize("answer", ["raises", "not an action"])
async def test_a_failed_strategy_event_says_whether_the_write_may_have_applied(answer: str) -> None:
    """The operator's one warning line for a write the strategy failed: the request failed,
    and whether the write may be on the server (as retry.not_retried says it)."""

    class Broken(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            if answer == "raises":
                raise ValueError("config service down")
            return "later"  # type: ignore[return-value]

    async def send(request: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED, effect=AttemptEffect.MAYBE_APPLIED)

    request = Request(name="kv.insert", idempotent=False, timeout=5.0)
    with capture_retry_events() as events, pytest.raises((ValueError, TypeError)):
        await RetryOrchestrator(Broken()).execute(request, send)
    (failed,) = [e for e in events if e["event"] == "retry.strategy_failed"]
    assert failed["request_id"] == request.id
    assert failed["ambiguous"] is True
    assert failed["maybe_applied"] is True
    assert failed["effect"] == "MAYBE_APPLIED"
    assert failed["timeout_ms"] == 5000.0
    assert failed["elapsed_ms"] >= 0.0
