"""CircuitBreaker: every rule of rfc/0007 on a fake clock, and exactly one probe under threads."""

from __future__ import annotations

import asyncio
import contextvars
import errno
import threading
from datetime import timedelta
from typing import Any

import anyio
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    CircuitBreaker,
    CircuitState,
    DocumentNotFoundException,
    RetryableError,
    RetryReason,
    TemporaryFailureException,
    UnambiguousTimeoutException,
)
from sdkcore.testing import capture_retry_events


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **kwargs: Any) -> CircuitBreaker:
    settings: dict[str, Any] = {
        "volume_threshold": 4,
        "error_threshold_percentage": 50,
        "sleep_window": 5.0,
        "rolling_window": 60.0,
        "canary_timeout": 2.0,
        "clock": clock,
        "name": "node1:11210",
    }
    settings.update(kwargs)
    return CircuitBreaker(**settings)


def trip(breaker: CircuitBreaker, n: int = 4) -> None:
    for _ in range(n):
        breaker.record_failure(TimeoutError("no answer"))
    assert breaker.state is CircuitState.OPEN


# -- construction ------------------------------------------------------------------


def test_defaults_match_couchbase() -> None:
    breaker = CircuitBreaker()
    assert breaker.state is CircuitState.CLOSED
    assert breaker.sleep_window == timedelta(seconds=5)
    assert breaker.canary_timeout == timedelta(seconds=5)
    assert breaker.counts == (0, 0)
    # 19 timeouts are below the default volume of 20; the 20th trips (100% >= 50%)
    for _ in range(19):
        breaker.record_failure(TimeoutError())
    assert breaker.state is CircuitState.CLOSED
    breaker.record_failure(TimeoutError())
    assert breaker.state is CircuitState.OPEN  # type: ignore[comparison-overlap]  # stale narrowing


def test_durations_take_timedelta_or_seconds() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=timedelta(milliseconds=1500), canary_timeout=1)
    assert breaker.sleep_window == timedelta(seconds=1.5)
    trip(breaker)
    clock.now += 1.499
    assert not breaker.try_acquire()
    clock.now += 0.001
    assert breaker.try_acquire()


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("volume_threshold", 0, ValueError),
        ("volume_threshold", 2.5, TypeError),
        ("volume_threshold", True, TypeError),
        ("error_threshold_percentage", 0, ValueError),
        ("error_threshold_percentage", 100.5, ValueError),
        ("error_threshold_percentage", float("nan"), ValueError),
        ("error_threshold_percentage", "50", TypeError),
        ("sleep_window", 0, ValueError),
        ("sleep_window", -1, ValueError),
        ("sleep_window", "5s", TypeError),
        ("sleep_window", 5000, ValueError),  # milliseconds meant: 83 minutes
        ("sleep_window", timedelta(hours=1, microseconds=1), ValueError),
        ("rolling_window", timedelta(0), ValueError),
        ("rolling_window", float("inf"), ValueError),
        ("canary_timeout", None, TypeError),
        ("canary_timeout", -0.5, ValueError),
        ("canary_timeout", 5000, ValueError),
        ("is_failure", 42, TypeError),
        ("clock", 1.0, TypeError),
        ("name", 7, TypeError),
    ],
)
def test_bad_settings_name_the_field(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"CircuitBreaker\({field}\)"):
        CircuitBreaker(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["sleep_window", "canary_timeout"])
def test_a_window_past_an_hour_is_refused_with_its_range(field: str) -> None:
    """``sleep_window=5000`` (someone meaning milliseconds: 83 minutes cut off) is refused,
    naming the field, the value and the range; an hour exactly is taken."""
    with pytest.raises(ValueError, match="at most") as refused:
        CircuitBreaker(**{field: 5000})  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"CircuitBreaker({field}) must be > 0 and at most 3600 seconds (1 hour), got 5000 "
        "(a number of seconds; for 5000 milliseconds give 5 or timedelta(milliseconds=5000))"
    )
    with pytest.raises(ValueError, match=r"\(1 hour\), got datetime\.timedelta\(seconds=7200\)$"):
        CircuitBreaker(**{field: timedelta(hours=2)})  # type: ignore[arg-type]  # a timedelta: no ms hint
    breaker = CircuitBreaker(**{field: timedelta(hours=1)})  # type: ignore[arg-type]
    assert getattr(breaker, field) == timedelta(hours=1)


# -- counting and tripping -----------------------------------------------------------


def test_trips_at_volume_and_percentage() -> None:
    clock = Clock()
    breaker = make(clock, volume_threshold=10, error_threshold_percentage=50)
    for _ in range(5):
        breaker.record_success()
    for _ in range(4):
        breaker.record_failure(TimeoutError())
    assert breaker.counts == (9, 4)
    assert breaker.state is CircuitState.CLOSED  # below the volume
    breaker.record_failure(TimeoutError())  # 10 outcomes, 5 failures: exactly 50%
    assert breaker.state is CircuitState.OPEN  # type: ignore[comparison-overlap]  # stale narrowing
    assert not breaker.try_acquire()


def test_below_percentage_stays_closed() -> None:
    breaker = make(Clock(), volume_threshold=10, error_threshold_percentage=50)
    for _ in range(6):
        breaker.record_success()
    for _ in range(4):
        breaker.record_failure(TimeoutError())
    for _ in range(20):
        breaker.record_success()
    assert breaker.state is CircuitState.CLOSED
    assert breaker.counts == (30, 4)


def test_a_success_at_the_volume_can_trip() -> None:
    # 3 failures then a success: 4 outcomes, 75% failed: the rule holds at the 4th outcome
    breaker = make(Clock(), volume_threshold=4, error_threshold_percentage=50)
    for _ in range(3):
        breaker.record_failure(TimeoutError())
    breaker.record_success()
    assert breaker.state is CircuitState.OPEN


def test_timeouts_and_unreachable_endpoints_count_by_default() -> None:
    breaker = make(Clock(), volume_threshold=4)
    error: Exception
    for error in (  # the server answered: alive
        DocumentNotFoundException(),
        TemporaryFailureException(),
        ValueError("bad frame"),
        OSError(errno.EACCES, "permission denied"),
    ):
        breaker.record_failure(error)
    assert breaker.counts == (4, 0)
    assert breaker.state is CircuitState.CLOSED
    for error in (
        TimeoutError(),
        asyncio.TimeoutError(),
        UnambiguousTimeoutException(),
        AmbiguousTimeoutException(),
    ):
        breaker.record_failure(error)
    assert breaker.counts == (8, 4)
    assert breaker.state is CircuitState.OPEN  # type: ignore[comparison-overlap]  # stale narrowing


def test_is_failure_decides() -> None:
    seen: list[BaseException] = []

    def down(error: BaseException) -> bool:
        seen.append(error)
        return isinstance(error, ConnectionError)

    breaker = make(Clock(), is_failure=down, volume_threshold=2)
    breaker.record_failure(TimeoutError())  # not counted by this rule: a success
    assert breaker.counts == (1, 0)
    breaker.record_failure(ConnectionRefusedError())
    assert breaker.state is CircuitState.OPEN
    assert [type(e) for e in seen] == [TimeoutError, ConnectionRefusedError]


def test_tumbling_window_restarts_at_first_event_after_it() -> None:
    clock = Clock()
    breaker = make(clock, volume_threshold=4, rolling_window=60.0)
    for _ in range(3):
        breaker.record_failure(TimeoutError())  # the window starts at t=1000
    clock.now += 59.999
    breaker.record_success()  # still in the window: 4 outcomes, 75% failed
    assert breaker.state is CircuitState.OPEN

    clock = Clock()
    breaker = make(clock, volume_threshold=4, rolling_window=60.0)
    for _ in range(3):
        breaker.record_failure(TimeoutError())
    clock.now += 60.0  # the window is over: the next event starts a new one
    breaker.record_failure(TimeoutError())
    assert breaker.counts == (1, 1)
    assert breaker.state is CircuitState.CLOSED
    # the new window started at that event (t=1060), not at 1000 + 2 * 60
    clock.now += 30.0
    for _ in range(3):
        breaker.record_failure(TimeoutError())
    assert breaker.state is CircuitState.OPEN  # type: ignore[comparison-overlap]  # stale narrowing


def test_window_does_not_slide() -> None:
    # tumbling: failures spread evenly across the boundary never add up
    clock = Clock()
    breaker = make(clock, volume_threshold=4, rolling_window=10.0)
    for _ in range(3):
        breaker.record_failure(TimeoutError())
        clock.now += 3.0
    clock.now += 2.0  # t = 1011: the window [1000, 1010) is over
    breaker.record_failure(TimeoutError())
    assert breaker.counts == (1, 1)
    assert breaker.state is CircuitState.CLOSED


# -- OPEN, the probe, HALF_OPEN --------------------------------------------------------


def test_open_refuses_until_the_sleep_window_is_over_then_one_probe() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0)
    trip(breaker)
    clock.now += 4.999
    assert not breaker.try_acquire()
    assert breaker.state is CircuitState.OPEN  # the window being over changes nothing by itself
    clock.now += 0.001
    assert breaker.state is CircuitState.OPEN
    assert breaker.try_acquire()  # the probe
    assert breaker.state is CircuitState.HALF_OPEN  # type: ignore[comparison-overlap]  # stale narrowing
    assert not breaker.try_acquire()
    assert breaker.admit() is None


def test_admit_says_which_dispatch_is_the_probe() -> None:
    clock = Clock()
    breaker = make(clock)
    assert breaker.admit() is CircuitState.CLOSED
    trip(breaker)
    assert breaker.admit() is None
    clock.now += 5.0
    assert breaker.admit() is CircuitState.HALF_OPEN
    assert breaker.admit() is None


def test_probe_success_closes_with_counters_zero() -> None:
    clock = Clock()
    breaker = make(clock)
    breaker.record_success()
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    breaker.record_success()
    assert breaker.state is CircuitState.CLOSED
    assert breaker.counts == (0, 0)
    # counting starts over: three failures are below the volume of four
    for _ in range(3):
        breaker.record_failure(TimeoutError())
    assert breaker.state is CircuitState.CLOSED


def test_probe_answered_with_an_error_closes() -> None:
    clock = Clock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    breaker.record_failure(DocumentNotFoundException())  # the server answered: alive
    assert breaker.state is CircuitState.CLOSED


def test_probe_failure_reopens_with_a_new_sleep_window_from_now() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0, canary_timeout=2.0)
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    clock.now += 1.5
    breaker.record_failure(TimeoutError())
    assert breaker.state is CircuitState.OPEN
    clock.now += 4.999
    assert not breaker.try_acquire()
    clock.now += 0.001
    assert breaker.try_acquire()


def test_canary_timeout_reopens_lazily_from_when_it_ran_out() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0, canary_timeout=2.0)
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()  # probe granted at t=1005
    clock.now += 1.999
    assert breaker.state is CircuitState.HALF_OPEN
    clock.now += 0.001  # t=1007: canary_timeout ran out
    assert breaker.state is CircuitState.OPEN  # type: ignore[comparison-overlap]  # stale narrowing
    # new sleep window from 1007, not from when someone looked
    clock.now = 1011.999
    assert not breaker.try_acquire()
    clock.now = 1012.0
    assert breaker.try_acquire()
    assert breaker.state is CircuitState.HALF_OPEN


def test_canary_timeout_found_by_try_acquire_long_after() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0, canary_timeout=2.0)
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    clock.now += 60.0  # nobody looked for a minute
    assert breaker.try_acquire()  # ran out at 1007, slept until 1012: a new probe now
    assert not breaker.try_acquire()


def test_canary_timeout_found_by_an_outcome() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0, canary_timeout=2.0)
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    clock.now += 3.0
    breaker.record_success()  # the probe's answer, too late: the breaker is OPEN again
    assert breaker.state is CircuitState.OPEN
    clock.now = 1011.999
    assert not breaker.try_acquire()
    clock.now = 1012.0
    assert breaker.try_acquire()


def test_late_outcomes_while_open_never_extend_the_sleep_window() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0)
    trip(breaker)  # opened at t=1000
    for _ in range(10):
        clock.now += 0.4
        breaker.record_failure(TimeoutError())  # in flight before the trip
    breaker.record_success()  # a late answer does not close it either
    assert breaker.state is CircuitState.OPEN
    clock.now = 1004.999
    assert not breaker.try_acquire()
    clock.now = 1005.0
    assert breaker.try_acquire()


def test_reset_closes_from_any_state() -> None:
    clock = Clock()
    breaker = make(clock)
    trip(breaker)
    breaker.reset()
    assert breaker.state is CircuitState.CLOSED
    assert breaker.counts == (0, 0)
    assert breaker.try_acquire()
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    breaker.reset()
    assert breaker.state is CircuitState.CLOSED
    breaker.record_failure(TimeoutError())
    assert breaker.counts == (1, 1)


def test_a_cancellation_is_no_outcome() -> None:
    clock = Clock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    breaker.record_failure(asyncio.CancelledError())
    breaker.record_failure(KeyboardInterrupt())
    assert breaker.state is CircuitState.HALF_OPEN
    breaker.reset()
    breaker.record_failure(asyncio.CancelledError())
    assert breaker.counts == (0, 0)


def test_record_failure_needs_an_exception() -> None:
    breaker = make(Clock())
    breaker.record_failure(TimeoutError())
    with pytest.raises(TypeError, match=r"record_failure\(error\) must be an exception"):
        breaker.record_failure("timeout")  # type: ignore[arg-type]
    assert breaker.counts == (1, 1)


def test_probe_after_and_repr() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0, canary_timeout=2.0)
    assert breaker.probe_after() is None
    trip(breaker)
    clock.now += 1.0
    assert breaker.probe_after() == pytest.approx(4.0)
    clock.now += 10.0
    assert breaker.probe_after() == 0.0
    assert breaker.try_acquire()
    assert breaker.probe_after() == pytest.approx(7.0)  # canary_timeout, then a sleep window
    assert "node1:11210" in repr(breaker)
    assert "HALF_OPEN" in repr(breaker)


# -- events ---------------------------------------------------------------------------


def test_events_name_the_endpoint_and_counts() -> None:
    clock = Clock()
    breaker = make(clock, sleep_window=5.0, canary_timeout=2.0)
    with capture_retry_events() as events:
        breaker.record_success()
        trip(breaker, 3)  # 4 outcomes, 3 failures
        clock.now += 5.0
        assert breaker.try_acquire()
        clock.now += 2.0
        assert breaker.state is CircuitState.OPEN  # canary timeout
        clock.now += 5.0
        assert breaker.try_acquire()
        breaker.record_failure(TimeoutError())
        clock.now += 5.0
        assert breaker.try_acquire()
        breaker.record_success()
        breaker.reset()  # already closed: no event
    names = [(e["event"], e.get("cause")) for e in events]
    assert names == [
        ("breaker.opened", "threshold"),
        ("breaker.half_open", None),
        ("breaker.opened", "canary_timeout"),
        ("breaker.half_open", None),
        ("breaker.opened", "probe_failed"),
        ("breaker.half_open", None),
        ("breaker.closed", "probe_succeeded"),
    ]
    first = events[0]
    assert first["endpoint"] == "node1:11210"
    assert (first["outcomes"], first["failures"]) == (4, 3)
    assert first["log_level"] == "warning"
    # Only the trip starts an outage: reopening after a canary timeout or a failed probe
    # is the same outage going on (a warning per sleep window would repeat all through it).
    assert [e["log_level"] for e in events[1:]] == ["info"] * 6
    with capture_retry_events() as events:
        trip(breaker)
        breaker.reset()
    assert [e["event"] for e in events] == ["breaker.opened", "breaker.closed"]
    assert events[1]["cause"] == "reset"


# -- concurrency --------------------------------------------------------------------------


def ask_at_once(
    breaker: CircuitBreaker, n: int, probes: list[contextvars.Context] | None = None
) -> list[bool]:
    """``n`` threads call try_acquire at the same instant (a barrier releases them).

    The thread granted the probe leaves its context in ``probes``: the probe's outcome
    is reported through it (``ctx.run(...)``), as rfc/0007 says a report from another
    thread must be.
    """
    barrier = threading.Barrier(n)
    granted: list[bool] = []
    lock = threading.Lock()

    def ask() -> None:
        barrier.wait()
        got = breaker.try_acquire()
        with lock:
            granted.append(got)
            if got and probes is not None:
                probes.append(contextvars.copy_context())

    threads = [threading.Thread(target=ask) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return granted


def test_exactly_one_probe_when_100_threads_ask_at_once() -> None:
    clock = Clock()
    breaker = make(clock)
    trip(breaker)
    for _ in range(5):  # several rounds: each sleep window gives exactly one probe
        clock.now += 5.0
        probes: list[contextvars.Context] = []
        granted = ask_at_once(breaker, 100, probes)
        assert len(granted) == 100
        assert granted.count(True) == 1
        assert breaker.state is CircuitState.HALF_OPEN
        breaker.record_failure(TimeoutError())  # not the probe's thread: ignored
        assert breaker.state is CircuitState.HALF_OPEN
        probes[0].run(breaker.record_failure, TimeoutError())  # the probe failed: OPEN again
        assert breaker.state is CircuitState.OPEN  # type: ignore[comparison-overlap]  # stale narrowing
        assert ask_at_once(breaker, 20).count(True) == 0


def test_counting_from_threads_loses_nothing() -> None:
    breaker = make(Clock(), volume_threshold=10**9)

    def work() -> None:
        for i in range(2000):
            if i % 4:
                breaker.record_success()
            else:
                breaker.record_failure(TimeoutError())

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert breaker.counts == (16000, 4000)


@pytest.mark.anyio
async def test_exactly_one_probe_when_100_tasks_ask_at_once() -> None:
    clock = Clock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5.0
    granted: list[bool] = []
    start = anyio.Event()

    async def ask() -> None:
        await start.wait()
        granted.append(breaker.try_acquire())

    async with anyio.create_task_group() as tg:
        for _ in range(100):
            tg.start_soon(ask)
        await anyio.lowlevel.checkpoint()
        start.set()
    assert granted.count(True) == 1
    assert len(granted) == 100


def test_lock_free_successes_from_threads_are_all_counted() -> None:
    breaker = make(Clock(), volume_threshold=10)

    def work() -> None:
        for _ in range(5000):
            breaker.record_success()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert breaker.counts == (40000, 0)
    for _ in range(10):
        breaker.record_failure(TimeoutError())
    assert breaker.state is CircuitState.CLOSED  # 10 of 40010 failed


@pytest.mark.anyio
async def test_a_probe_cancelled_without_an_outcome_frees_the_probe() -> None:
    """The probe's dispatch cancelled from elsewhere (a hedge copy that lost to a faster
    replica): no outcome, yet the probe stayed out. The endpoint was cut off until
    canary_timeout, then the breaker reopened with cause canary_timeout, a timeout that
    never happened. The next dispatch is the probe now."""
    clock = Clock()
    breaker = make(clock)
    trip(breaker)
    clock.now += 5.0  # the sleep window is over
    with capture_retry_events() as events:
        with anyio.CancelScope() as scope:
            with breaker.guard():  # this dispatch is the probe
                assert breaker.state is CircuitState.HALF_OPEN
                scope.cancel()  # the copy lost the race: cancelled, no outcome
                await anyio.sleep(1)
        assert scope.cancelled_caught
        assert breaker.state is CircuitState.HALF_OPEN
        assert breaker.probe_after() == 0.0
        assert breaker.admit() is CircuitState.HALF_OPEN  # the next dispatch probes at once
        assert not breaker.try_acquire()  # one probe out at a time
        breaker.record_success()  # the new probe's outcome decides
        clock.now += 10.0  # past canary_timeout: nothing is left to time out
    assert breaker.state is CircuitState.CLOSED  # type: ignore[comparison-overlap]  # stale narrowing
    causes = [e.get("cause") for e in events if e["event"].startswith("breaker.")]
    assert "canary_timeout" not in causes
    assert [e["event"] for e in events if e["event"] == "breaker.half_open"] == [
        "breaker.half_open"
    ]


# -- a failure that says nothing was sent -------------------------------------------------


def test_a_nested_breakers_refusal_is_no_outcome_for_the_outer_probe() -> None:
    """A per-node breaker inside a per-service one: the node's refusal (nothing was sent)
    closed the service's HALF_OPEN breaker as a success, on a probe that never reached the
    endpoint. It is no outcome: the probe is free again for the next dispatch."""
    clock = Clock()
    outer = make(clock, volume_threshold=1, name="service")
    node = make(clock, volume_threshold=1, sleep_window=100.0, name="node")
    outer.record_failure(TimeoutError("down"))
    node.record_failure(TimeoutError("down"))
    clock.now += 6.0  # the service's probe may go; the node's breaker is still sleeping
    with pytest.raises(RetryableError) as refused, outer.guard(), node.guard():
        pass  # never runs
    assert refused.value.reason is RetryReason.CIRCUIT_BREAKER_OPEN
    assert outer.state is CircuitState.HALF_OPEN  # not CLOSED
    with outer.guard() as state:  # the probe is free: this dispatch is it
        assert state is CircuitState.HALF_OPEN
    assert outer.state is CircuitState.CLOSED  # type: ignore[comparison-overlap]  # stale narrowing


@pytest.mark.parametrize(
    ("error", "counted"),
    [
        (RetryableError(RetryReason.SOCKET_NOT_AVAILABLE, "pool empty"), (0, 0)),  # default
        (RetryableError(RetryReason.KV_LOCKED, effect=AttemptEffect.NOT_SENT), (0, 0)),
        (RetryableError(RetryReason.KV_LOCKED), (1, 0)),  # reached the server: a success
    ],
    ids=["reason's default", "explicit effect", "sent"],
)
def test_a_failure_that_sent_nothing_is_not_counted_while_closed(
    error: RetryableError, counted: tuple[int, int]
) -> None:
    breaker = make(Clock())
    breaker.record_failure(error)
    assert breaker.counts == counted


def test_a_refused_connection_still_counts_as_a_failure() -> None:
    """The default rule counts a refused connection (the endpoint is down), though the
    RetryableError that carries it says nothing was sent."""
    breaker = make(Clock(), volume_threshold=1)
    try:
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    except ConnectionRefusedError as exc:
        failure = RetryableError(RetryReason.SOCKET_NOT_AVAILABLE, "cannot connect", cause=exc)
    breaker.record_failure(failure)
    assert breaker.state is CircuitState.OPEN


@pytest.mark.parametrize(
    "reason", [RetryReason.AUTHENTICATION_ERROR, RetryReason.COLLECTION_NOT_FOUND]
)
def test_a_terminal_answer_to_the_probe_closes_the_breaker(reason: RetryReason) -> None:
    """The terminal reasons also default to "nothing sent" (found before the request is
    written) but they are the endpoint's answer: it is alive, the probe closes the
    breaker as any answer does."""
    clock = Clock()
    breaker = make(clock, volume_threshold=1)
    breaker.record_failure(TimeoutError("down"))
    clock.now += 6.0
    with pytest.raises(RetryableError), breaker.guard():
        raise RetryableError(reason, "answered by the endpoint")
    assert breaker.state is CircuitState.CLOSED
