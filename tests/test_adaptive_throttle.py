"""AdaptiveThrottle: Google SRE client-side throttling, on a virtual clock (rfc/0009).

The formula is checked exactly; randomness comes from an injected source.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from bad_numbers import judge

from sdkcore import (
    AttemptEffect,
    CircuitBreaker,
    DocumentNotFoundException,
    QuotaLimitedException,
    RateLimitedException,
    RetryableError,
    RetryReason,
    TemporaryFailureException,
    UnambiguousTimeoutException,
)
from sdkcore._throttle import (
    EVENT_THROTTLE_REFUSING,
    REFUSAL_REASON,
    AdaptiveThrottle,
    default_is_rejection,
)
from sdkcore.mapping import KvStatus, grpc_failure, kv_failure
from sdkcore.testing import VirtualClock, capture_retry_events

TEMP = RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "busy")


def never() -> float:
    """A random source for throttles that must not refuse: nothing is below 1."""
    return 1.0


def always() -> float:
    """A random source that refuses whenever the probability is above 0."""
    return 0.0


def make(
    k: float = 2.0,
    window: float = 120.0,
    random: Callable[[], float] = never,
    **kw: Any,
) -> tuple[AdaptiveThrottle, VirtualClock]:
    vc = VirtualClock()
    return AdaptiveThrottle(k, window=window, clock=vc.clock, random=random, **kw), vc


def feed(throttle: AdaptiveThrottle, accepts: int, rejects: int) -> None:
    for _ in range(accepts):
        throttle.record_success()
    for _ in range(rejects):
        throttle.record_failure(TEMP)


def sre(requests: int, accepts: int, k: float) -> float:
    return max(0.0, (requests - k * accepts) / (requests + 1))


# -- the formula -------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1.0, 1.1, 2.0, 3.5])
@pytest.mark.parametrize(
    ("accepts", "rejects"), [(0, 0), (0, 1), (3, 10), (10, 3), (5, 5), (0, 50)]
)
def test_rejection_probability_is_the_sre_formula(k: float, accepts: int, rejects: int) -> None:
    throttle, _ = make(k)
    feed(throttle, accepts, rejects)
    assert throttle.requests == accepts + rejects
    assert throttle.accepts == accepts
    assert throttle.rejection_probability == sre(accepts + rejects, accepts, k)


def test_a_fresh_throttle_and_one_that_only_succeeds_never_asks_the_random_source() -> None:
    def forbidden() -> float:
        raise AssertionError("random asked while the probability is 0")

    throttle, _ = make(random=forbidden)
    for _ in range(1000):
        with throttle.guard():
            pass
    assert throttle.rejection_probability == 0.0
    assert (throttle.requests, throttle.accepts, throttle.refused) == (1000, 1000, 0)


def test_k_requests_per_accept_are_let_through_before_any_refusal() -> None:
    # requests - k * accepts <= 0 until requests exceed k * accepts (the SRE book's words)
    throttle, _ = make(k=2.0, random=always)
    feed(throttle, accepts=10, rejects=10)  # 20 requests, 2 * 10 accepts: still 0
    assert throttle.rejection_probability == 0.0
    assert throttle.admit()
    throttle.record_failure(TEMP)  # 21 requests
    assert throttle.rejection_probability == pytest.approx(1 / 22)
    assert not throttle.admit()


def test_a_local_refusal_counts_as_a_request_and_raises_before_the_block() -> None:
    throttle, _ = make(random=always)
    feed(throttle, accepts=1, rejects=3)  # 4 requests, 1 accept: (4 - 2) / 5
    assert throttle.rejection_probability == pytest.approx(0.4)
    ran = False
    with pytest.raises(RetryableError) as caught, throttle.guard():
        ran = True
    assert not ran
    error = caught.value
    assert error.reason is REFUSAL_REASON
    assert REFUSAL_REASON.name in ("CLIENT_THROTTLED", "SERVICE_NOT_AVAILABLE")
    # nothing was sent: unambiguous, retryable even when not idempotent, never "always"
    assert REFUSAL_REASON.allows_non_idempotent_retry
    assert not REFUSAL_REASON.always_retry
    assert not REFUSAL_REASON.after_dispatch
    assert error.effect is AttemptEffect.NOT_SENT
    assert error.retry_after is None
    assert "nothing was sent" in str(error)
    assert (throttle.requests, throttle.accepts, throttle.refused) == (5, 1, 1)
    assert throttle.rejection_probability == sre(5, 1, 2.0)


def test_a_refusal_says_the_probability_and_the_windows_counts() -> None:
    """The refusal's message gives the numbers it was made from, as they stand with the
    refused request counted: the rejection probability, requests and accepts in the
    window, the window's length and k (an operator sees why, and how far from recovery)."""
    throttle, _ = make(random=always, name="node1")
    feed(throttle, accepts=1, rejects=3)
    with pytest.raises(RetryableError) as caught, throttle.guard():
        pass
    assert str(caught.value) == (
        "CLIENT_THROTTLED: adaptive throttle node1 refused the request locally (the backend "
        "rejected too many recently: rejection probability 0.5 from 5 requests and 1 accept "
        "in its 120 s window, k 2): nothing was sent"
    )
    assert throttle.rejection_probability == sre(5, 1, 2.0) == 0.5
    unnamed, _ = make(k=1.5, window=1.0, random=always)
    feed(unnamed, accepts=0, rejects=1)
    assert str(unnamed.refusal()) == (
        "CLIENT_THROTTLED: adaptive throttle refused the request locally (the backend "
        "rejected too many recently: rejection probability 0.5 from 1 request and 0 accepts "
        "in its 1 s window, k 1.5): nothing was sent"
    )


def test_the_accept_path_builds_no_refusal() -> None:
    """The numbers are read when a request is refused, never when one is admitted: an
    admission reads the clock once and takes no lock (the hot path stays as it was)."""
    readings = 0
    vc = VirtualClock()

    def clock() -> float:
        nonlocal readings
        readings += 1
        return vc.clock()

    throttle = AdaptiveThrottle(window=120.0, clock=clock, random=always)
    readings = 0
    for _ in range(100):
        with throttle.guard():
            pass
    assert readings == 200  # one to admit, one to record each success
    feed(throttle, accepts=0, rejects=300)  # 400 requests, 100 accepts: (400 - 200) / 401
    readings = 0
    with pytest.raises(RetryableError, match="rejection probability"), throttle.guard():
        pass
    assert readings > 1  # the refusal read the window again to give its counts


def test_the_random_source_decides_against_the_probability() -> None:
    draws = iter([0.39, 0.5, 0.49])
    throttle, _ = make(random=lambda: next(draws))
    feed(throttle, accepts=1, rejects=3)  # p = (4 - 2) / 5 = 0.4
    assert not throttle.admit()  # 0.39 < 0.4: refused; 5 requests, p = 3 / 6
    assert throttle.rejection_probability == 0.5
    assert throttle.admit()  # 0.5 is not below 0.5: admitted, and nothing counted yet
    assert throttle.rejection_probability == 0.5
    assert not throttle.admit()  # 0.49 < 0.5


def test_draw_by_draw() -> None:
    draws: list[float] = []
    source = iter([0.49, 0.5, 0.51])

    def random() -> float:
        value = next(source)
        draws.append(value)
        return value

    throttle, _ = make(random=random)
    feed(throttle, accepts=0, rejects=1)  # p = 1 / 2
    assert throttle.rejection_probability == 0.5
    assert not throttle.admit()  # 0.49 < 0.5: refused; now 2 requests, p = 2/3
    assert throttle.rejection_probability == pytest.approx(2 / 3)
    assert not throttle.admit()  # 0.5 < 2/3: refused; p = 3/4
    assert not throttle.admit()  # 0.51 < 3/4
    assert draws == [0.49, 0.5, 0.51]
    assert throttle.refused == 3


def test_admitted_when_the_draw_is_at_or_above_the_probability() -> None:
    throttle, _ = make(random=lambda: 0.5)
    feed(throttle, accepts=0, rejects=1)  # p = 0.5 exactly
    assert throttle.admit()  # 0.5 is not below 0.5
    assert throttle.refused == 0


def test_sent_attempts_per_accept_stay_within_k_against_a_backend_at_a_quarter_capacity() -> None:
    """The SRE bound: a backend that can serve 1 request in 4 offered (it rejects the rest)
    receives about k attempts per accepted one, the rest refused locally."""
    import random as stdlib_random

    rng = stdlib_random.Random(7)
    vc = VirtualClock()
    throttle = AdaptiveThrottle(
        2.0, window=timedelta(seconds=60), clock=vc.clock, random=rng.random
    )
    capacity = 5  # requests served per 10 ms tick; 20 offered
    sent = accepted = 0
    for _ in range(6000):  # 60 s
        served = 0
        for _ in range(4 * capacity):
            if not throttle.admit():
                continue
            sent += 1
            if served < capacity:
                served += 1
                accepted += 1
                throttle.record_success()
            else:
                throttle.record_failure(TEMP)
        vc.advance(0.01)
    assert accepted > 0.95 * 6000 * capacity  # the backend stays fully used
    assert sent / accepted <= 2.0 + 0.1


# -- what counts -------------------------------------------------------------------------


class FakeRpcError(Exception):
    """Duck-typed grpc.aio.AioRpcError: ``code()`` returns a status with a ``name``."""

    def __init__(self, code: object) -> None:
        super().__init__(str(code))
        self._code = code

    def code(self) -> object:
        return self._code


class Named:
    def __init__(self, name: str) -> None:
        self.name = name


def _from(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def _aio(code_name: str) -> BaseException:
    grpc = pytest.importorskip("grpc")
    from grpc import aio

    error: BaseException = aio.AioRpcError(
        getattr(grpc.StatusCode, code_name), aio.Metadata(), aio.Metadata()
    )
    return error


REJECTIONS: list[tuple[str, Callable[[], BaseException]]] = [
    ("KV_TEMPORARY_FAILURE", lambda: RetryableError(RetryReason.KV_TEMPORARY_FAILURE)),
    ("KV BUSY as mapped", lambda: RetryableError(_kv_reason(KvStatus.BUSY))),
    ("SEARCH_TOO_MANY_REQUESTS", lambda: RetryableError(RetryReason.SEARCH_TOO_MANY_REQUESTS)),
    (
        "SERVICE_NOT_AVAILABLE answered",
        lambda: RetryableError(
            RetryReason.SERVICE_NOT_AVAILABLE, effect=AttemptEffect.MAYBE_APPLIED
        ),
    ),
    ("grpc_failure UNAVAILABLE", lambda: grpc_failure("UNAVAILABLE")),
    ("grpc_failure RESOURCE_EXHAUSTED", lambda: grpc_failure("RESOURCE_EXHAUSTED")),
    ("RateLimitedException", lambda: RateLimitedException()),
    ("QuotaLimitedException", lambda: QuotaLimitedException()),
    ("TemporaryFailureException", lambda: TemporaryFailureException()),
    ("kv_failure RATE_LIMITED", lambda: _kv_error(KvStatus.RATE_LIMITED_MAX_COMMANDS)),
    ("duck RESOURCE_EXHAUSTED", lambda: FakeRpcError(Named("RESOURCE_EXHAUSTED"))),
    ("duck UNAVAILABLE", lambda: FakeRpcError(Named("UNAVAILABLE"))),
    ("duck numeric 14", lambda: FakeRpcError(14)),
    ("grpc.aio RESOURCE_EXHAUSTED", lambda: _aio("RESOURCE_EXHAUSTED")),
    ("grpc.aio UNAVAILABLE", lambda: _aio("UNAVAILABLE")),
    (
        "retryable raised from RESOURCE_EXHAUSTED",
        lambda: _from(
            RetryableError(RetryReason.SERVICE_RESPONSE_CODE_INDICATED),
            FakeRpcError(Named("RESOURCE_EXHAUSTED")),
        ),
    ),
    ("wrapped rate limit", lambda: _from(RuntimeError("wrapped"), RateLimitedException())),
]

ACCEPTS: list[tuple[str, Callable[[], BaseException]]] = [
    ("KV_LOCKED", lambda: RetryableError(RetryReason.KV_LOCKED)),
    (
        "SERVICE_RESPONSE_CODE_INDICATED",
        lambda: RetryableError(RetryReason.SERVICE_RESPONSE_CODE_INDICATED),
    ),
    ("DocumentNotFoundException", lambda: DocumentNotFoundException()),
    ("TimeoutError", lambda: TimeoutError()),
    ("UnambiguousTimeoutException", lambda: UnambiguousTimeoutException()),
    ("KeyError", lambda: KeyError("x")),
    ("duck NOT_FOUND", lambda: FakeRpcError(Named("NOT_FOUND"))),
    ("duck DEADLINE_EXCEEDED", lambda: FakeRpcError(Named("DEADLINE_EXCEEDED"))),
    ("grpc.aio INTERNAL", lambda: _aio("INTERNAL")),
    ("code() that raises", lambda: _BrokenCode()),
    ("code attribute not callable", lambda: _CodeAttr()),
]

NOTHING: list[tuple[str, Callable[[], BaseException]]] = [
    ("asyncio.CancelledError", lambda: asyncio.CancelledError()),
    ("KeyboardInterrupt", lambda: KeyboardInterrupt()),
    ("GeneratorExit", lambda: GeneratorExit()),
    (
        "CIRCUIT_BREAKER_OPEN (not sent)",
        lambda: RetryableError(RetryReason.CIRCUIT_BREAKER_OPEN),
    ),
    ("SERVICE_NOT_AVAILABLE (not sent)", lambda: RetryableError(RetryReason.SERVICE_NOT_AVAILABLE)),
    (
        "KV_TEMPORARY_FAILURE marked NOT_SENT",
        lambda: RetryableError(RetryReason.KV_TEMPORARY_FAILURE, effect=AttemptEffect.NOT_SENT),
    ),
    ("another throttle's refusal", lambda: AdaptiveThrottle().refusal()),
]


def _kv_reason(status: int) -> RetryReason:
    reason = kv_failure(status, 0)
    assert isinstance(reason, RetryReason)
    return reason


def _kv_error(status: int) -> BaseException:
    error = kv_failure(status, 0)
    assert isinstance(error, BaseException)
    return error


class _BrokenCode(Exception):
    def code(self) -> object:
        raise RuntimeError("no code")


class _CodeAttr(Exception):
    code = 14  # not callable: not a gRPC error


@pytest.mark.parametrize("build", [b for _, b in REJECTIONS], ids=[n for n, _ in REJECTIONS])
def test_overload_answers_are_rejections(build: Callable[[], BaseException]) -> None:
    error = build()
    assert default_is_rejection(error)
    throttle, _ = make()
    with pytest.raises(type(error)), throttle.guard():
        raise error
    assert (throttle.requests, throttle.accepts) == (1, 0)


@pytest.mark.parametrize("build", [b for _, b in ACCEPTS], ids=[n for n, _ in ACCEPTS])
def test_other_answers_are_accepts(build: Callable[[], BaseException]) -> None:
    error = build()
    assert not default_is_rejection(error)
    throttle, _ = make()
    with pytest.raises(type(error)), throttle.guard():
        raise error
    assert (throttle.requests, throttle.accepts) == (1, 1)


@pytest.mark.parametrize("build", [b for _, b in NOTHING], ids=[n for n, _ in NOTHING])
def test_cancellations_and_unsent_attempts_record_nothing(
    build: Callable[[], BaseException],
) -> None:
    error = build()
    throttle, _ = make()
    with pytest.raises(type(error)), throttle.guard():
        raise error
    assert (throttle.requests, throttle.accepts) == (0, 0)


def test_a_success_is_a_request_and_an_accept() -> None:
    throttle, _ = make()
    with throttle.guard():
        pass
    assert (throttle.requests, throttle.accepts) == (1, 1)


def test_is_rejection_replaces_the_default_rule() -> None:
    seen: list[BaseException] = []

    def timeouts_only(error: BaseException) -> bool:
        seen.append(error)
        return isinstance(error, TimeoutError)

    throttle, _ = make(is_rejection=timeouts_only)
    for error in (TimeoutError(), TEMP, asyncio.CancelledError()):
        with pytest.raises(type(error)), throttle.guard():
            raise error
    # the timeout is a rejection, KV_TEMPORARY_FAILURE an accept; the cancellation is not asked
    assert (throttle.requests, throttle.accepts) == (2, 1)
    assert len(seen) == 2


def test_default_rule_composes_with_timeouts() -> None:
    throttle, _ = make(
        is_rejection=lambda e: default_is_rejection(e) or isinstance(e, TimeoutError)
    )
    throttle.record_failure(TimeoutError())
    throttle.record_failure(TEMP)
    throttle.record_failure(KeyError())
    assert (throttle.requests, throttle.accepts) == (3, 1)


def test_user_code_runs_without_the_lock_held() -> None:
    # is_rejection and random read the throttle (which takes its lock): no deadlock.
    throttle_box: list[AdaptiveThrottle] = []

    def is_rejection(error: BaseException) -> bool:
        return throttle_box[0].requests >= 0

    def random() -> float:
        return 1.0 if throttle_box[0].rejection_probability >= 0 else 0.0

    throttle, _ = make(is_rejection=is_rejection, random=random)
    throttle_box.append(throttle)
    throttle.record_failure(KeyError())
    assert throttle.admit()
    assert throttle.requests == 1


def test_a_broken_is_rejection_propagates_its_error() -> None:
    def broken(error: BaseException) -> bool:
        raise ZeroDivisionError

    throttle, _ = make(is_rejection=broken)
    with pytest.raises(ZeroDivisionError):
        throttle.record_failure(KeyError())
    assert throttle.requests == 0


def test_record_failure_refuses_what_is_not_an_exception() -> None:
    throttle, _ = make()
    with pytest.raises(TypeError, match=r"AdaptiveThrottle.record_failure\(error\)"):
        throttle.record_failure("boom")  # type: ignore[arg-type]


def test_composes_with_a_breaker_refusal_inside() -> None:
    # A breaker (or another guard) that refuses inside the throttle's guard: nothing was
    # sent, so the throttle records nothing.
    vc = VirtualClock()
    breaker = CircuitBreaker(volume_threshold=1, clock=vc.clock)
    breaker.record_failure(TimeoutError())  # OPEN
    throttle, _ = make()
    with pytest.raises(RetryableError) as caught, throttle.guard(), breaker.guard():
        pass
    assert caught.value.reason is RetryReason.CIRCUIT_BREAKER_OPEN
    assert throttle.requests == 0


@pytest.mark.anyio
async def test_a_cancelled_await_inside_the_guard_records_nothing(anyio_backend: str) -> None:
    throttle, _ = make()
    with anyio.move_on_after(0.01):
        with throttle.guard():
            await anyio.sleep_forever()
    assert (throttle.requests, throttle.accepts) == (0, 0)
    with throttle.guard():
        await anyio.lowlevel.checkpoint()
    assert (throttle.requests, throttle.accepts) == (1, 1)


# -- the window --------------------------------------------------------------------------


def test_counts_leave_after_the_window() -> None:
    throttle, vc = make(window=10.0, random=always)
    feed(throttle, accepts=0, rejects=5)
    assert throttle.rejection_probability == pytest.approx(5 / 6)
    vc.advance(10.0)
    assert throttle.requests == 0
    assert throttle.rejection_probability == 0.0
    assert throttle.admit()  # and the fast path is back


def test_counts_leave_in_tenths_between_0_9_and_1_window() -> None:
    throttle, vc = make(window=10.0)
    vc.now = 1000.0  # a slice boundary (slices of 1 s)
    feed(throttle, accepts=0, rejects=4)  # in the slice [1000, 1001)
    vc.advance(0.5)
    feed(throttle, accepts=2, rejects=0)  # same slice
    vc.advance(5.0)  # 1005.5
    feed(throttle, accepts=1, rejects=1)  # slice [1005, 1006)
    assert (throttle.requests, throttle.accepts) == (8, 3)
    vc.now = 1009.99
    assert (throttle.requests, throttle.accepts) == (8, 3)  # 9.99 s after the first: kept
    vc.now = 1010.0
    assert (throttle.requests, throttle.accepts) == (2, 1)  # the first slice left
    vc.now = 1015.0
    assert (throttle.requests, throttle.accepts) == (0, 0)


def test_lock_free_successes_are_counted_in_their_slice() -> None:
    throttle, vc = make(window=10.0)
    vc.now = 1000.0
    for _ in range(7):
        throttle.record_success()  # lock-free
    vc.now = 1003.0
    throttle.record_failure(TEMP)  # takes the lock, moves the window: the 7 stay in slice 1000
    assert (throttle.requests, throttle.accepts) == (8, 7)
    vc.now = 1010.5
    assert (throttle.requests, throttle.accepts) == (1, 0)


def test_a_clock_that_steps_back_keeps_the_counts() -> None:
    throttle, vc = make(window=10.0)
    feed(throttle, accepts=1, rejects=3)
    vc.now -= 50.0
    feed(throttle, accepts=0, rejects=1)
    assert (throttle.requests, throttle.accepts) == (5, 1)


def test_refusal_episode_logs_once() -> None:
    throttle, vc = make(window=10.0, random=always, name="cache:11211")
    feed(throttle, accepts=0, rejects=3)
    with capture_retry_events() as events:
        for _ in range(5):
            assert not throttle.admit()
        vc.advance(10.0)  # the window empties: p = 0
        assert throttle.admit()
        throttle.record_failure(TEMP)
        throttle.record_failure(TEMP)
        assert not throttle.admit()  # a new episode
    refusing = [e for e in events if e["event"] == EVENT_THROTTLE_REFUSING]
    assert len(refusing) == 2
    assert refusing[0]["throttle"] == "cache:11211"
    assert refusing[0]["rejection_probability"] == pytest.approx(0.75)
    assert refusing[0]["log_level"] == "warning"  # an episode starts


# -- thread safety -----------------------------------------------------------------------


def _threads(count: int, work: Callable[[int], None]) -> None:
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_32_threads_count_every_outcome() -> None:
    throttle, _ = make(window=100.0)
    per_thread = 2000

    def work(i: int) -> None:
        for n in range(per_thread):
            if n % 4 == 0:
                with pytest.raises(RetryableError), throttle.guard():
                    raise TEMP
            else:
                with throttle.guard():
                    pass

    _threads(32, work)
    assert throttle.requests == 32 * per_thread
    assert throttle.accepts == 32 * per_thread * 3 // 4


def test_32_threads_while_the_window_moves() -> None:
    vc = VirtualClock()
    vc.now = 1000.0
    clock_lock = threading.Lock()
    throttle = AdaptiveThrottle(window=100.0, clock=vc.clock, random=never)
    per_thread = 1000

    def work(i: int) -> None:
        for n in range(per_thread):
            if i == 0 and n % 20 == 0:
                with clock_lock:
                    vc.now += 1.0  # 50 s in all: nothing leaves the 100 s window
            if n % 2:
                throttle.record_success()
            else:
                throttle.record_failure(TEMP)

    _threads(32, work)
    assert (throttle.requests, throttle.accepts) == (32 * per_thread, 32 * per_thread // 2)


def test_32_threads_refusing_count_each_refusal_once() -> None:
    throttle, _ = make(window=100.0, random=always)
    feed(throttle, accepts=0, rejects=10)

    def work(i: int) -> None:
        for _ in range(500):
            assert not throttle.admit()

    _threads(32, work)
    assert throttle.refused == 32 * 500
    assert throttle.requests == 10 + 32 * 500


# -- bad input ---------------------------------------------------------------------------

BAD_NUMBERS: list[Any] = [
    float("inf"),
    float("-inf"),
    float("nan"),
    10**400,
    -(10**400),
    True,
    -1,
    0,
    0.5,
    "2",
    None,
]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize(
    ("field", "build"),
    [
        ("k", lambda v: AdaptiveThrottle(v)),
        ("window", lambda v: AdaptiveThrottle(window=v)),
    ],
)
def test_bad_numbers_are_refused_naming_the_field(
    field: str, build: Callable[[Any], object], value: Any
) -> None:
    with pytest.raises((TypeError, ValueError)) as caught:
        build(value)
    assert not isinstance(caught.value, OverflowError)
    assert f"AdaptiveThrottle({field})" in str(caught.value)
    judge(build, value, named="AdaptiveThrottle")


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"k": 0.99}, ValueError, "k"),
        ({"k": 2**1100}, ValueError, "k"),
        ({"window": timedelta(days=2)}, ValueError, "window"),
        ({"window": timedelta(milliseconds=999)}, ValueError, "window"),
        ({"window": "2m"}, TypeError, "window"),
        ({"name": None}, TypeError, "name"),
        ({"name": 3}, TypeError, "name"),
        ({"clock": 3.0}, TypeError, "clock"),
        ({"random": 0.5}, TypeError, "random"),
        ({"is_rejection": True}, TypeError, "is_rejection"),
    ],
)
def test_bad_parameters_name_the_field(
    kwargs: dict[str, Any], error: type[Exception], field: str
) -> None:
    with pytest.raises(error, match=rf"AdaptiveThrottle\({field}\)"):
        AdaptiveThrottle(**kwargs)


def test_defaults_and_repr() -> None:
    throttle = AdaptiveThrottle()
    assert throttle.k == 2.0
    assert throttle.window == timedelta(minutes=2)
    assert throttle.name == ""
    assert throttle.rejection_probability == 0.0
    assert "AdaptiveThrottle" in repr(throttle)
    assert AdaptiveThrottle(1, window=1, name="x").k == 1.0  # int k, numeric window accepted


def test_guard_is_one_shared_object() -> None:
    throttle = AdaptiveThrottle()
    assert throttle.guard() is throttle.guard()


@pytest.mark.parametrize("reading", ["nan", "inf", "raises"])
def test_a_broken_clock_never_replaces_a_successful_answer(reading: str) -> None:
    now = [0.0]

    def clock() -> float:
        if now[0] > 0.0:
            if reading == "raises":
                raise RuntimeError("clock")
            return float(reading)
        return 0.0

    throttle = AdaptiveThrottle(window=10.0, clock=clock)
    with throttle.guard():
        now[0] = 1.0  # the clock breaks while the request is in flight
        answer = "ok"
    assert answer == "ok"  # the answer stands: the outcome is not recorded
    throttle.record_failure(ValueError("rejected"))  # records nothing, raises nothing
    if reading != "raises":
        assert throttle.admit()  # no window to judge by: admitted, not an OverflowError


@pytest.mark.parametrize("reading", [math.nan, math.inf, 10**400])
def test_the_properties_read_the_counts_as_they_are_when_the_clock_breaks(
    reading: float,
) -> None:
    """``admit()`` and the records take a NaN, an infinity or a number past a float's range
    as "no window to judge by"; the properties raised on them (``cannot convert float NaN
    to integer``, an OverflowError) and so did ``repr`` (a review)."""
    now: list[float] = [0.0]
    throttle = AdaptiveThrottle(window=10.0, clock=lambda: now[0], is_rejection=lambda e: True)
    throttle.record_failure(ValueError("rejected"))
    assert (throttle.requests, throttle.accepts) == (1, 0)
    now[0] = reading
    assert (throttle.requests, throttle.accepts) == (1, 0)
    assert throttle.rejection_probability == 0.5
    assert "AdaptiveThrottle" in repr(throttle)
    assert throttle.admit()
    throttle.record_success()  # records nothing, raises nothing
    throttle.record_failure(ValueError("rejected"))
    assert (throttle.requests, throttle.accepts) == (1, 0)
