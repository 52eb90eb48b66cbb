"""Load-shedding episodes in the logs: each refusal episode logs its start and its end.

``budget.exhausted`` / ``budget.recovered``, ``throttle.refusing`` /
``throttle.recovered``, ``limiter.refusing`` / ``limiter.recovered``, and the adaptive
limiter's ``limiter.limit_changed`` (only on moves of a factor of 2 or more). Every
clock is injected; nothing here waits on real time. Also: the success paths ask no
log level and take no lock, and the docstrings say what the code does.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import pytest

from sdkcore import RetryableError, RetryReason
from sdkcore import _log as log_module
from sdkcore._adaptive_limiter import MIN_WINDOW, AdaptiveConcurrencyLimiter
from sdkcore._budget import RetryBudget
from sdkcore._limiter import ConcurrencyLimiter
from sdkcore._permits import MAX_SLACK, SLACK
from sdkcore._throttle import EVENT_THROTTLE_RECOVERED, EVENT_THROTTLE_REFUSING, AdaptiveThrottle
from sdkcore.testing import VirtualClock, capture_retry_events

Events = list[MutableMapping[str, Any]]

TEMP = RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "busy")


def named(events: Events, *names: str) -> Events:
    return [e for e in events if e["event"] in names]


class CountingLock:
    """Stands in for an object's ``threading.Lock``: counts acquisitions."""

    def __init__(self) -> None:
        self.taken = 0

    def __enter__(self) -> None:
        self.taken += 1

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def gate_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times sdkcore asked for a log level (``_log.enabled``) since the fixture."""
    calls = [0]
    real = log_module.enabled

    def counting(level: int) -> Any:
        calls[0] += 1
        return real(level)

    monkeypatch.setattr(log_module, "enabled", counting)
    return calls


# -- RetryBudget ----------------------------------------------------------------------------


def test_budget_recovered_ends_the_episode_with_its_refusals_and_duration() -> None:
    vc = VirtualClock(100.0)
    # a reserve of one retry, nothing earned: the retry comes back as its slice expires
    budget = RetryBudget(ttl=1, min_retries_per_sec=1, retry_ratio=0, clock=vc.clock, name="kv")
    with capture_retry_events() as events:
        assert budget.try_withdraw()
        assert not budget.try_withdraw()  # the episode starts: budget.exhausted
        vc.advance(0.25)
        assert not budget.try_withdraw()
        vc.advance(0.25)
        assert not budget.try_withdraw()
        vc.advance(1.0)  # the granted withdrawal left the window
        assert budget.try_withdraw()  # the episode ends: budget.recovered
        vc.advance(2.0)
        assert budget.try_withdraw()  # no episode: nothing
    assert [e["event"] for e in events] == ["budget.exhausted", "budget.recovered"]
    assert [e["log_level"] for e in events] == ["warning", "info"]  # rfc/0001, "Levels"
    recovered = events[1]
    assert recovered == {
        "event": "budget.recovered",
        "log_level": "info",
        "budget": "kv",
        "refused": 3,
        "duration_ms": 1500.0,
        "balance": 0,
    }
    assert budget.refused == 3


def test_budget_episodes_repeat_and_each_counts_its_own_refusals() -> None:
    vc = VirtualClock(100.0)
    budget = RetryBudget(ttl=1, min_retries_per_sec=1, retry_ratio=0, clock=vc.clock)
    with capture_retry_events() as events:
        for refusals in (2, 5):
            assert budget.try_withdraw()
            for _ in range(refusals):
                assert not budget.try_withdraw()
            vc.advance(1.5)
        assert budget.try_withdraw()
    assert [(e["event"], e.get("refused")) for e in events] == [
        ("budget.exhausted", None),
        ("budget.recovered", 2),
        ("budget.exhausted", None),
        ("budget.recovered", 5),
    ]
    # unnamed: None, as an unnamed breaker's ``endpoint`` (rfc/0007: name=None)
    assert {e["budget"] for e in events} == {None}
    assert [e["duration_ms"] for e in events if e["event"] == "budget.recovered"] == [
        1500.0,
        1500.0,
    ]


def test_budget_grants_and_deposits_ask_no_log_level(gate_calls: list[int]) -> None:
    vc = VirtualClock(100.0)
    budget = RetryBudget(clock=vc.clock)
    for _ in range(50):
        budget.deposit()
        assert budget.try_withdraw()
    assert gate_calls[0] == 0
    empty = RetryBudget(ttl=1, min_retries_per_sec=1, retry_ratio=0, clock=vc.clock)
    assert empty.try_withdraw()
    assert not empty.try_withdraw()
    assert gate_calls[0] == 1  # budget.exhausted
    vc.advance(1.5)
    assert empty.try_withdraw()
    assert gate_calls[0] == 2  # budget.recovered
    vc.advance(1.5)
    assert empty.try_withdraw()
    assert gate_calls[0] == 2


# -- AdaptiveThrottle -----------------------------------------------------------------------


def refusing_throttle(name: str = "cache:11211") -> tuple[AdaptiveThrottle, VirtualClock]:
    """A throttle that refuses whenever the probability is above 0, with 3 rejections in."""
    vc = VirtualClock(1000.0)
    throttle = AdaptiveThrottle(window=10.0, clock=vc.clock, random=lambda: 0.0, name=name)
    for _ in range(3):
        throttle.record_failure(TEMP)
    return throttle, vc


def test_throttle_recovered_ends_the_episode_with_its_refusals_and_duration() -> None:
    throttle, vc = refusing_throttle()
    with capture_retry_events() as events:
        assert not throttle.admit()  # throttle.refusing
        vc.advance(0.5)
        assert not throttle.admit()
        vc.advance(0.5)
        assert not throttle.admit()
        vc.advance(10.0)  # the window empties: p = 0
        assert throttle.rejection_probability == 0.0  # a gauge read does not end it
        assert named(events, EVENT_THROTTLE_RECOVERED) == []
        assert throttle.admit()  # throttle.recovered
        assert throttle.admit()
    assert [e["event"] for e in events] == [EVENT_THROTTLE_REFUSING, EVENT_THROTTLE_RECOVERED]
    assert [e["log_level"] for e in events] == ["warning", "info"]
    assert events[1] == {
        "event": "throttle.recovered",
        "log_level": "info",
        "throttle": "cache:11211",
        "refused": 3,
        "duration_ms": 11000.0,
    }


def test_throttle_admissions_while_probability_is_above_zero_do_not_end_the_episode() -> None:
    vc = VirtualClock(1000.0)
    draws = iter([0.0, 0.99, 0.99, 0.0])  # refused, admitted twice (p < 1), refused
    throttle = AdaptiveThrottle(window=10.0, clock=vc.clock, random=lambda: next(draws))
    for _ in range(3):
        throttle.record_failure(TEMP)
    with capture_retry_events() as events:
        assert not throttle.admit()
        assert throttle.admit()
        assert throttle.admit()
        assert not throttle.admit()
        vc.advance(20.0)
        assert throttle.admit()
    assert [(e["event"], e.get("refused")) for e in events] == [
        (EVENT_THROTTLE_REFUSING, None),
        (EVENT_THROTTLE_RECOVERED, 2),
    ]
    assert events[1]["throttle"] == ""  # unnamed (rfc/0009: name="")


def test_throttle_after_recovery_admits_without_lock_or_log_level(gate_calls: list[int]) -> None:
    throttle, vc = refusing_throttle()
    assert not throttle.admit()
    vc.advance(10.5)
    lock = CountingLock()
    throttle._lock = lock  # type: ignore[assignment]  # a counting stand-in
    calls = gate_calls[0]
    assert throttle.admit()  # ends the episode: the lock, once
    assert lock.taken == 1
    assert gate_calls[0] == calls + 1
    for _ in range(20):
        assert throttle.admit()
        throttle.record_success()
    assert lock.taken == 1  # the fast path again
    assert gate_calls[0] == calls + 1


# -- ConcurrencyLimiter and AdaptiveConcurrencyLimiter: refusal episodes -----------------------


def make_limiter(kind: str, clock: VirtualClock, name: str = "db:5432") -> Any:
    if kind == "fixed":
        return ConcurrencyLimiter(1, name=name, clock=clock.clock)
    return AdaptiveConcurrencyLimiter(1, 1, 1, name=name, clock=clock.clock)


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_limiter_logs_refusing_then_recovered_once(kind: str) -> None:
    vc = VirtualClock(50.0)
    limiter = make_limiter(kind, vc)
    with capture_retry_events() as events:
        with limiter.guard():
            for _ in range(3):
                with pytest.raises(RetryableError), limiter.guard():
                    pass
                vc.advance(0.125)
        vc.advance(0.125)
        with limiter.guard():  # 0.25 s after the last refusal: the episode goes on
            pass
        vc.advance(0.875)
        with limiter.guard():  # a quiet second after it: limiter.recovered
            pass
        with limiter.guard():
            pass
    shedding = named(events, "limiter.refusing", "limiter.recovered")
    assert shedding == [
        {
            "event": "limiter.refusing",
            "log_level": "warning",  # an episode starts (rfc/0001, "Levels")
            "limiter": "db:5432",
            "limit": 1,
            "in_flight": 1,
            "queued": 0,
        },
        {
            "event": "limiter.recovered",
            "log_level": "info",
            "limiter": "db:5432",
            "refused": 3,
            "duration_ms": 1375.0,
            "limit": 1,
        },
    ]
    assert limiter.in_flight == 0


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_an_unnamed_limiter_is_the_empty_string(kind: str) -> None:
    vc = VirtualClock(50.0)
    limiter = make_limiter(kind, vc, name="")
    with capture_retry_events() as events:
        with limiter.guard(), pytest.raises(RetryableError), limiter.guard():
            pass
        vc.advance(1.0)
        with limiter.guard():
            pass
    assert [(e["event"], e["limiter"]) for e in named(events, "limiter.refusing")] == [
        ("limiter.refusing", "")
    ]
    assert [e["limiter"] for e in named(events, "limiter.recovered")] == [""]


async def turns(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("the condition never came true")


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
async def test_a_queued_caller_handed_the_permit_ends_the_episode(kind: str) -> None:
    vc = VirtualClock(0.0)
    if kind == "fixed":
        limiter: Any = ConcurrencyLimiter(1, max_queued=1, name="q", clock=vc.clock)
    else:
        limiter = AdaptiveConcurrencyLimiter(1, 1, 1, max_queued=1, name="q", clock=vc.clock)
    served: list[str] = []

    async def queued() -> None:
        async with limiter.acquire():
            served.append("queued")

    with capture_retry_events() as events:
        held = limiter.guard()
        held.__enter__()
        async with anyio.create_task_group() as tg:
            tg.start_soon(queued)
            await turns(lambda: limiter.queued == 1)
            with pytest.raises(RetryableError), limiter.guard():  # someone is in line
                pass
            vc.advance(1.0)  # a quiet second after the refusal
            held.__exit__(None, None, None)  # handed to the queued caller
    assert served == ["queued"]
    shedding = named(events, "limiter.refusing", "limiter.recovered")
    assert [(e["event"], e.get("queued"), e.get("refused")) for e in shedding] == [
        ("limiter.refusing", 1, None),
        ("limiter.recovered", None, 1),
    ]
    assert shedding[1]["duration_ms"] == 1000.0
    assert limiter.in_flight == 0


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_granted_permits_ask_no_log_level_and_take_no_lock(
    kind: str, gate_calls: list[int]
) -> None:
    vc = VirtualClock(50.0)
    limiter = make_limiter(kind, vc)
    lock = CountingLock()
    limiter._lock = lock
    for _ in range(50):
        with limiter.guard():
            vc.advance(0.001)
    assert gate_calls[0] == 0
    with limiter.guard(), pytest.raises(RetryableError), limiter.guard():
        pass
    assert gate_calls[0] == 1  # limiter.refusing
    taken = lock.taken
    for _ in range(50):  # within the quiet second: the episode goes on, one clock read each
        with limiter.guard():
            pass
    assert gate_calls[0] == 1
    assert lock.taken == taken
    vc.advance(1.0)
    with limiter.guard():
        pass
    assert gate_calls[0] == 2  # limiter.recovered
    taken = lock.taken
    for _ in range(50):
        with limiter.guard():
            pass  # no time passes: no window closes
    assert gate_calls[0] == 2
    assert lock.taken == taken


class RaisingOn:
    """A logger whose ``info`` raises for one event (a broken log pipeline)."""

    def __init__(self, event: str) -> None:
        self.event = event

    def info(self, event: str, **fields: Any) -> None:
        if event == self.event:
            raise RuntimeError(f"cannot log {event}")


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_a_log_that_raises_on_recovery_gives_the_permit_back(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    vc = VirtualClock(50.0)
    limiter = make_limiter(kind, vc)
    with limiter.guard(), pytest.raises(RetryableError), limiter.guard():
        pass
    vc.advance(1.0)
    monkeypatch.setattr(log_module, "enabled", lambda level: RaisingOn("limiter.recovered"))
    with pytest.raises(RuntimeError, match=r"limiter\.recovered"), limiter.guard():
        pass
    assert limiter.in_flight == 0
    with limiter.guard():
        assert limiter.in_flight == 1
    assert limiter.in_flight == 0


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_sustained_overload_is_one_episode_not_a_flood(kind: str) -> None:
    """At twice its capacity a limiter grants and refuses in turn every few milliseconds:
    one limiter.refusing, and one limiter.recovered a quiet second after the overload."""
    vc = VirtualClock(50.0)
    limiter = make_limiter(kind, vc)
    with capture_retry_events() as events:
        for _ in range(2000):  # 10 s: a grant, then a refusal while it is held, 5 ms apart
            with limiter.guard():
                vc.advance(0.0025)
                with pytest.raises(RetryableError), limiter.guard():
                    pass
            vc.advance(0.0025)
        vc.advance(1.0)
        with limiter.guard():
            pass
    shedding = named(events, "limiter.refusing", "limiter.recovered")
    assert [e["event"] for e in shedding] == ["limiter.refusing", "limiter.recovered"]
    assert shedding[1]["refused"] == 2000
    assert shedding[1]["duration_ms"] == pytest.approx(10_997.5)


def test_a_budget_that_grants_and_refuses_in_turn_is_one_episode() -> None:
    vc = VirtualClock(100.0)
    # one retry a second: under twice that demand every other withdrawal is refused
    budget = RetryBudget(ttl=1, min_retries_per_sec=1, retry_ratio=0, clock=vc.clock)
    granted = 0
    with capture_retry_events() as events:
        for _ in range(20):  # 10 s at two withdrawals a second
            granted += budget.try_withdraw()
            vc.advance(0.5)
        vc.advance(1.0)
        assert budget.try_withdraw()
    assert 0 < granted < 20
    assert [(e["event"], e.get("refused")) for e in events] == [
        ("budget.exhausted", None),
        ("budget.recovered", 20 - granted),
    ]


# -- AdaptiveConcurrencyLimiter: limiter.limit_changed ---------------------------------------


def one_at_a_time(limiter: AdaptiveConcurrencyLimiter, clock: VirtualClock, rtt: float) -> None:
    """About 12 windows of one-at-a-time dispatches: app-limited, the limit stays."""
    end = clock.now + 12 * MIN_WINDOW
    while clock.now < end:
        with limiter.guard():
            clock.advance(rtt)


def batches(
    limiter: AdaptiveConcurrencyLimiter,
    clock: VirtualClock,
    rtt: float,
    *,
    windows: float = 1,
    n: int | None = None,
    until: Callable[[], bool] = lambda: False,
) -> None:
    """``windows`` windows' worth of batches (or fewer, once ``until()``): ``n`` (default:
    the limit) dispatches let in together, all answered ``rtt`` later."""
    end = clock.now + windows * MIN_WINDOW
    while clock.now < end and not until():
        held = [limiter.guard() for _ in range(limiter.limit if n is None else n)]
        for permit in held:
            permit.__enter__()
        clock.advance(rtt)
        for permit in held:
            permit.__exit__(None, None, None)


def warmed() -> tuple[AdaptiveConcurrencyLimiter, VirtualClock]:
    clock = VirtualClock(0.0)
    limiter = AdaptiveConcurrencyLimiter(name="kv:11210", clock=clock.clock)
    one_at_a_time(limiter, clock, 0.011)
    assert limiter.baseline_rtt == pytest.approx(0.011)
    assert limiter.limit == 20
    return limiter, clock


def timeout(limiter: AdaptiveConcurrencyLimiter, clock: VirtualClock) -> None:
    clock.advance(0.02)
    permit = limiter.guard()
    permit.__enter__()
    clock.advance(0.1)
    permit.__exit__(TimeoutError, TimeoutError("no answer"), None)


def test_limit_halved_by_timeouts_logs_each_halving_as_a_drop() -> None:
    limiter, clock = warmed()
    with capture_retry_events() as events:
        for _ in range(6):
            timeout(limiter, clock)
    changes = named(events, "limiter.limit_changed")
    assert [(e["previous"], e["limit"], e["cause"]) for e in changes] == [
        (20, 10, "drop"),
        (10, 5, "drop"),
        (5, 2, "drop"),
        (2, 1, "drop"),  # then min_limit: nothing more
    ]
    first = changes[0]
    assert first["log_level"] == "info"
    assert first["limiter"] == "kv:11210"
    assert first["baseline_rtt_ms"] == pytest.approx(11.0)
    # the window's average round trip, or None when it held only the timeout
    assert all(e["rtt_ms"] is None or e["rtt_ms"] == pytest.approx(11.0) for e in changes)


def test_limit_growing_logs_once_it_has_doubled() -> None:
    limiter, clock = warmed()
    with capture_retry_events() as events:
        while limiter.limit < 40:
            batches(limiter, clock, 0.010)  # faster than the baseline: grow
            assert clock.now < 100.0, "never grew to 40"
        batches(limiter, clock, 0.010, windows=5)  # still growing, not to 80
    assert 40 < limiter.limit < 80
    changes = named(events, "limiter.limit_changed")
    assert len(changes) == 1
    assert {k: v for k, v in changes[0].items() if k not in ("baseline_rtt_ms", "limit")} == {
        "event": "limiter.limit_changed",
        "log_level": "info",
        "limiter": "kv:11210",
        "previous": 20,
        "rtt_ms": 10.0,
        "cause": "gradient",
    }
    assert changes[0]["limit"] in (40, 41)  # the first limit at twice 20 (it grows by < 2)
    assert 10.0 < changes[0]["baseline_rtt_ms"] <= 11.0


def test_a_limit_that_wiggles_logs_nothing_and_asks_no_log_level(gate_calls: list[int]) -> None:
    limiter, clock = warmed()
    seen = set()
    with capture_retry_events() as events:
        for _ in range(8):
            for rtt in (0.010, 0.010, 0.020, 0.020):  # up twice, down twice
                batches(limiter, clock, rtt)
                seen.add(limiter.limit)
    assert len(seen) >= 5  # it did move, every window or so
    assert min(seen) > 10
    assert max(seen) < 40
    assert named(events, "limiter.limit_changed") == []
    assert gate_calls[0] == 0  # not once per dispatch, nor per window


def test_a_probe_logs_the_halving_and_the_restore() -> None:
    clock = VirtualClock(0.0)
    limiter = AdaptiveConcurrencyLimiter(20, 1, 20, name="p", clock=clock.clock)
    with capture_retry_events() as events:
        # saturated warm-up (12 of 20 in use): its baseline may be our own queue, so
        # it is re-measured at half the limit
        def changes(count: int) -> Callable[[], bool]:
            return lambda: len(named(events, "limiter.limit_changed")) >= count

        while not changes(1)():
            batches(limiter, clock, 0.011, n=12, until=changes(1))
            assert clock.now < 10.0, "no probe"
        assert limiter.limit == 10
        while not changes(2)():
            batches(limiter, clock, 0.011, until=changes(2))
            assert clock.now < 20.0, "the probe never ended"
    assert limiter.limit == 20
    logged = named(events, "limiter.limit_changed")
    assert [(e["previous"], e["limit"], e["cause"]) for e in logged] == [
        (20, 10, "probe"),
        (10, 20, "probe_end"),
    ]
    assert logged[0]["rtt_ms"] == pytest.approx(11.0)  # the window that started it
    assert logged[1]["rtt_ms"] == pytest.approx(11.0)  # what the probe measured
    assert logged[1]["baseline_rtt_ms"] == pytest.approx(11.0)


# -- the docstrings say what the code does -------------------------------------------------------


def flat(text: str | None) -> str:
    return " ".join((text or "").split())


def test_the_queue_wait_margin_in_the_docstring_is_the_codes() -> None:
    doc = flat(ConcurrencyLimiter.__doc__)
    assert "(1 ms)" not in doc
    margin = f"a tenth of the time it had left when it queued, at least {SLACK * 1000:g} ms and "
    assert margin + f"at most {MAX_SLACK * 1000:g} ms, before it" in doc


def test_the_budget_docstrings_are_general_and_say_things_once() -> None:
    refund = flat(RetryBudget.refund.__doc__)
    assert "withdrawal whose retry was never sent" in refund
    assert "cut before it was sent" in refund
    assert "copy that an OPEN circuit breaker refused" not in refund  # not the only caller
    assert flat(RetryBudget.__doc__).count("one retry per five first attempts") == 1
