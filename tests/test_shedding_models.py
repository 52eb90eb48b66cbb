"""Seeded randomized checks of the load-shedding primitives against brute-force models (rfc/0009).

* ``AdaptiveThrottle``: every event kept with its timestamp; the window applied as rfc/0009
  documents it (ten slices of ``window / 10``, slice number ``int(t * 10 / window)``: an event
  counts while its slice is one of the last ten), plus the documented bound (counted events
  are younger than ``window``, every event younger than ``0.9 window`` is counted).
* ``ConcurrencyLimiter`` / ``AdaptiveConcurrencyLimiter``: a FIFO queue model, driven on
  asyncio and trio, and guard() from threads.
* ``LatencyQuantile``: the exact nearest rank over the kept latencies (recomputed when a
  slice turns over, as documented), for streams where the tail logic cannot engage, and
  the documented looser bounds otherwise.

Clocks are injected; every failure names the seed and the step.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sniffio

from sdkcore import (
    AttemptEffect,
    RateLimitedException,
    Request,
    RetryableError,
    TemporaryFailureException,
)
from sdkcore._adaptive_limiter import AdaptiveConcurrencyLimiter
from sdkcore._latency import _CUT, _FOLD, RELATIVE_ERROR, LatencyQuantile
from sdkcore._limiter import ConcurrencyLimiter
from sdkcore._permits import LIMITED
from sdkcore._reason import RetryReason
from sdkcore._throttle import REFUSAL_REASON, AdaptiveThrottle
from sdkcore.testing import VirtualClock

NOT_SENT = AttemptEffect.NOT_SENT


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


# ============================================================================================
# AdaptiveThrottle
# ============================================================================================


class FakeGrpcError(Exception):
    def __init__(self, status: object) -> None:
        super().__init__(f"grpc {status}")
        self._status = status

    def code(self) -> object:
        return self._status


def _chained(outer: Exception, inner: BaseException) -> Exception:
    outer.__cause__ = inner
    return outer


# (label, factory, verdict under the default rule): "reject", "accept" or "nothing"
# (nothing recorded: NOT_SENT or not an Exception). Verdicts written from rfc/0009.
ERRORS: list[tuple[str, Callable[[], BaseException], str]] = [
    ("kv-tmpfail", lambda: RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "busy"), "reject"),
    ("429", lambda: RetryableError(RetryReason.SEARCH_TOO_MANY_REQUESTS, "429"), "reject"),
    (
        "unavailable-sent",
        lambda: RetryableError(
            RetryReason.SERVICE_NOT_AVAILABLE, "u", effect=AttemptEffect.MAYBE_APPLIED
        ),
        "reject",
    ),
    ("rate-limited", lambda: RateLimitedException("rl"), "reject"),
    ("tmpfail-exc", lambda: TemporaryFailureException("t"), "reject"),
    ("grpc-exhausted", lambda: FakeGrpcError(_Named("RESOURCE_EXHAUSTED")), "reject"),
    ("grpc-14", lambda: FakeGrpcError(14), "reject"),
    ("grpc-notfound", lambda: FakeGrpcError(_Named("NOT_FOUND")), "accept"),
    ("from-429", lambda: _chained(ValueError("wrapped"), RateLimitedException("rl")), "reject"),
    ("kv-locked", lambda: RetryableError(RetryReason.KV_LOCKED, "locked"), "accept"),
    ("value-error", lambda: ValueError("no such doc"), "accept"),
    ("timeout", lambda: TimeoutError("slow"), "accept"),
    (
        "not-sent-unavailable",
        lambda: RetryableError(RetryReason.SERVICE_NOT_AVAILABLE, "breaker"),
        "nothing",
    ),
    (
        "not-sent-explicit",
        lambda: RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "x", effect=NOT_SENT),
        "nothing",
    ),
    ("cancelled", lambda: KeyboardInterrupt(), "nothing"),
    ("limiter-refusal", lambda: RetryableError(LIMITED, "full", effect=NOT_SENT), "nothing"),
]


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


def _custom_rule(error: BaseException) -> bool:
    """A custom is_rejection: timeouts and ValueErrors (and nothing else)."""
    return isinstance(error, (TimeoutError, ValueError))


def _custom_verdict(error: BaseException, default: str) -> str:
    if default == "nothing":
        return "nothing"  # cancellations and NOT_SENT are never asked about
    return "reject" if _custom_rule(error) else "accept"


class ThrottleModel:
    """Every event (time, accepted) kept; the window applied exactly as documented."""

    def __init__(self, k: float, window: float) -> None:
        self.k = k
        self.window = window
        self.per_slice = 10 / window  # the documented slices: window / 10 each
        self.events: list[tuple[float, float, bool]] = []  # (time, slice, accepted)
        self.refused = 0
        # The newest slice the clock has read: a clock that steps back keeps the counts
        # in the newer slice (rfc/0009), so an event goes there.
        self.high = -math.inf
        self.went_back = False

    def slice_of(self, t: float) -> int:
        return int(t * self.per_slice)

    def counts(self, now: float) -> tuple[int, int]:
        self.high = current = max(self.high, self.slice_of(now))
        kept = [a for _, s, a in self.events if s > current - 10]
        return len(kept), sum(kept)

    def bound_counts(self, now: float) -> tuple[int, int, int, int]:
        """(requests, accepts) surely counted (age < 0.9 window) and possibly (age < window)."""
        sure = [a for t, _, a in self.events if now - t < 0.9 * self.window]
        maybe = [a for t, _, a in self.events if now - t < self.window]
        return len(sure), sum(sure), len(maybe), sum(maybe)

    def probability(self, now: float) -> float:
        requests, accepts = self.counts(now)
        return max(0.0, (requests - self.k * accepts) / (requests + 1))

    def add(self, now: float, accepted: bool) -> None:
        self.high = max(self.high, self.slice_of(now))
        self.events.append((now, self.high, accepted))


class ScriptedRandom:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next: float | None = None
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        value = self.next if self.next is not None else self.rng.random()
        self.next = None
        self.last = value
        return value


def _check_throttle(
    throttle: AdaptiveThrottle, model: ThrottleModel, now: float, where: str
) -> None:
    expected = model.counts(now)
    actual = (throttle.requests, throttle.accepts)
    assert actual == expected, f"{where}: (requests, accepts) model {expected} != {actual}"
    if model.went_back:
        sure_r, sure_a, maybe_r, maybe_a = 0, 0, 10**9, 10**9  # ages mean nothing then
    else:
        sure_r, sure_a, maybe_r, maybe_a = model.bound_counts(now)
    assert sure_r <= actual[0] <= maybe_r, f"{where}: requests {actual[0]} outside bound"
    assert sure_a <= actual[1] <= maybe_a, f"{where}: accepts {actual[1]} outside bound"
    p = model.probability(now)
    assert throttle.rejection_probability == p, (
        f"{where}: rejection_probability model {p} != {throttle.rejection_probability}"
    )
    assert throttle.refused == model.refused, (
        f"{where}: refused {model.refused} != {throttle.refused}"
    )


@pytest.mark.parametrize("seed", range(12))
def test_throttle_matches_the_windowed_model(seed: int) -> None:
    rng = random.Random(seed)
    window = rng.choice([1.0, 2.0, 10.0, 20.0, 40.0])  # 10 / window exact in binary
    k = rng.choice([1.0, 1.5, 2.0, 3.0])
    custom = seed % 3 == 2
    clock = Clock(1000.0 + rng.randrange(64) / 64)
    source = ScriptedRandom(random.Random(seed * 7919))
    throttle = AdaptiveThrottle(
        k,
        window=window,
        clock=clock,
        random=source,
        is_rejection=_custom_rule if custom else None,
    )
    model = ThrottleModel(k, window)
    reject_bias = rng.random()
    for step in range(500):
        where = f"seed={seed} step={step} window={window} k={k} custom={custom} t={clock.now}"
        op = rng.random()
        if op < 0.15:  # move the clock: mostly within a slice, sometimes across the window
            tick = window / 10
            clock.now += rng.choice(
                [1 / 64, tick / 2, tick, 3 * tick, 0.9 * window, window, 2 * window]
            ) * rng.choice([1, 1, 1, 2])
            clock.now = round(clock.now * 64) / 64
        elif op < 0.17 and seed % 4 == 3:  # a clock that steps back (up to a slice or two)
            clock.now -= rng.choice([1 / 64, window / 10, window / 5])
            model.went_back = True
        elif op < 0.2:  # bad input: a clear TypeError, the state intact
            with pytest.raises(TypeError, match=r"record_failure\(error\) must be an exception"):
                throttle.record_failure("boom")  # type: ignore[arg-type]
        else:
            p = model.probability(clock.now)
            if p > 0 and rng.random() < 0.2:
                source.next = p  # exactly the probability: admitted (refused only below it)
            calls = source.calls
            label, make, verdict = ("ok", None, "accept")
            if rng.random() < reject_bias:
                label, make, verdict = rng.choice(ERRORS)
                if custom:
                    verdict = _custom_verdict(make(), verdict)
            ran = False
            raised: BaseException | None = None
            try:
                with throttle.guard():
                    ran = True
                    if rng.random() < 0.15:  # the request takes time: to the next slice edge
                        edge = math.floor(clock.now * model.per_slice + 1) / model.per_slice
                        clock.now = rng.choice([edge, edge - 1 / 64, clock.now + 1 / 64])
                    if make is not None:
                        raise make()
            except BaseException as error:  # the refusal, or the block's own error
                raised = error
            if not ran:
                assert isinstance(raised, RetryableError), f"{where}: {raised!r}"
                assert raised.reason is REFUSAL_REASON, f"{where}: {raised.reason}"
                assert raised.effect is NOT_SENT, where
                assert raised.retry_after is None, where
            asked = source.calls - calls
            if p > 0:
                assert asked == 1, f"{where}: random asked {asked} times at p={p}"
                expect_refused = source.last < p
            else:
                assert asked == 0, f"{where}: random asked at probability 0"
                expect_refused = False
            assert ran == (not expect_refused), (
                f"{where}: p={p} random={source.last if asked else None} refused={not ran} "
                f"model says refused={expect_refused}"
            )
            if not ran:
                model.refused += 1
                model.add(clock.now, False)  # a refusal is a request (SRE book)
            elif verdict != "nothing":
                model.add(clock.now, verdict == "accept")
            where += f" op={label}"
        _check_throttle(throttle, model, clock.now, where)


def test_throttle_refusals_count_as_requests() -> None:
    # only rejections: every refusal is one more request and no accept (the SRE book),
    # so the probability climbs towards 1 as refusals pile up
    clock = Clock(500.0)
    throttle = AdaptiveThrottle(2.0, window=10.0, clock=clock, random=lambda: 0.0)
    with pytest.raises(RateLimitedException), throttle.guard():
        raise RateLimitedException("no")
    assert (throttle.requests, throttle.accepts) == (1, 0)
    for i in range(1, 50):
        with pytest.raises(RetryableError):
            enter(throttle)
        assert (throttle.requests, throttle.accepts, throttle.refused) == (1 + i, 0, i)
        assert throttle.rejection_probability == (1 + i) / (2 + i)


def enter(throttle: AdaptiveThrottle) -> None:
    with throttle.guard():
        pytest.fail("a refused block must not run")


BAD_THROTTLE: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"k": 0.5}, ValueError, r"AdaptiveThrottle\(k\) must be a finite number >= 1"),
    ({"k": math.nan}, ValueError, r"AdaptiveThrottle\(k\)"),
    ({"k": math.inf}, ValueError, r"AdaptiveThrottle\(k\)"),
    ({"k": 10**400}, ValueError, r"AdaptiveThrottle\(k\)"),
    ({"k": True}, TypeError, r"AdaptiveThrottle\(k\) must be an int or float"),
    ({"k": "2"}, TypeError, r"AdaptiveThrottle\(k\)"),
    ({"window": 0.5}, ValueError, r"AdaptiveThrottle\(window\) must be between 1 second"),
    ({"window": 86401.0}, ValueError, r"AdaptiveThrottle\(window\)"),
    ({"window": math.nan}, ValueError, r"AdaptiveThrottle\(window\)"),
    ({"window": timedelta(0)}, ValueError, r"AdaptiveThrottle\(window\)"),
    ({"name": 3}, TypeError, r"AdaptiveThrottle\(name\) must be a str"),
    ({"clock": 3.0}, TypeError, r"AdaptiveThrottle\(clock\)"),
    ({"random": 0.5}, TypeError, r"AdaptiveThrottle\(random\)"),
    ({"is_rejection": True}, TypeError, r"AdaptiveThrottle\(is_rejection\)"),
]


@pytest.mark.parametrize(("kwargs", "kind", "message"), BAD_THROTTLE)
def test_throttle_bad_arguments_are_refused_clearly(
    kwargs: dict[str, Any], kind: type[Exception], message: str
) -> None:
    with pytest.raises(kind, match=message):
        AdaptiveThrottle(**kwargs)


# ============================================================================================
# ConcurrencyLimiter / AdaptiveConcurrencyLimiter on asyncio and trio
# ============================================================================================


class LimiterModel:
    """Holders and a FIFO queue; a returned permit goes to the first in line."""

    def __init__(self, limit: int, max_queued: int) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.holders: set[int] = set()
        self.queue: list[int] = []

    def arrive(self, who: int) -> str:
        if not self.queue and len(self.holders) < self.limit:
            self.holders.add(who)
            return "granted"
        if len(self.queue) >= self.max_queued:
            return "refused"
        self.queue.append(who)
        return "queued"

    def release(self, who: int) -> None:
        self.holders.remove(who)
        self.fill()

    def fill(self) -> None:
        while self.queue and len(self.holders) < self.limit:
            self.holders.add(self.queue.pop(0))


async def _settle() -> None:
    """Let every woken task run until it blocks again (no clock involved)."""
    if sniffio.current_async_library() == "trio":
        for _ in range(2):
            await anyio.wait_all_tasks_blocked()
            await anyio.lowlevel.checkpoint()
    else:  # anyio's asyncio version polls every 0.1 s: a few turns of the loop suffice
        for _ in range(12):
            await anyio.lowlevel.checkpoint()


class Driver:
    """Tasks that acquire a permit and hold it until told; what actually happened."""

    def __init__(self, limiter: Any, tg: Any, where: Callable[[], str]) -> None:
        self.limiter = limiter
        self.tg = tg
        self.where = where
        self.holding: set[int] = set()
        self.grants: list[int] = []
        self.outcome: dict[int, str] = {}
        self.release: dict[int, anyio.Event] = {}
        self.scopes: dict[int, anyio.CancelScope] = {}
        self.done: dict[int, anyio.Event] = {}
        self.rtts: list[float] = []  # the round trips of the dispatches that ended
        self.errors: list[str] = []
        self.time_out: set[int] = set()  # holders whose dispatch ends in a timeout (a drop)
        self.over_limit: list[str] = []

    def check_hint(self, error: RetryableError, who: object) -> None:
        """retry_after: None for a fixed limit; for the adaptive one None (nothing measured
        yet) or a round trip measured earlier (rfc/0009)."""
        hint = error.retry_after
        if isinstance(self.limiter, ConcurrencyLimiter):
            ok = hint is None
        else:
            ok = hint is None or any(abs(hint - r) < 1e-9 for r in self.rtts if r > 0)
        if not ok:
            self.errors.append(f"{self.where()} who={who}: retry_after {hint} (rtts {self.rtts})")

    def spawn(self, who: int, request: Request | None = None) -> None:
        self.release[who] = anyio.Event()
        self.done[who] = anyio.Event()
        self.scopes[who] = anyio.CancelScope()
        self.tg.start_soon(self._run, who, request)

    async def _run(self, who: int, request: Request | None) -> None:
        limiter = self.limiter
        mark = None if request is None else request._dispatching()
        try:
            with self.scopes[who]:
                try:
                    async with limiter.acquire():
                        if limiter.in_flight > limiter.limit:
                            self.over_limit.append(
                                f"{self.where()} who={who}: in_flight {limiter.in_flight} > "
                                f"limit {limiter.limit} at a grant"
                            )
                        self.holding.add(who)
                        self.grants.append(who)
                        start = limiter._clock()
                        try:
                            await self.release[who].wait()
                            if who in self.time_out:
                                raise TimeoutError("the endpoint did not answer")
                        finally:
                            self.holding.discard(who)
                            self.rtts.append(limiter._clock() - start)
                    self.outcome[who] = "released"
                except TimeoutError:
                    self.outcome[who] = "timed out"
                except RetryableError as error:
                    self.outcome[who] = "refused"
                    if error.reason is not LIMITED or error.effect is not NOT_SENT:
                        self.errors.append(f"{self.where()} who={who}: bad refusal {error!r}")
                    self.check_hint(error, who)
            if who not in self.outcome:
                self.outcome[who] = "cancelled"
        finally:
            if mark is not None:
                Request._dispatched_done(mark)
            self.done[who].set()


def _check_limiter_state(limiter: Any, model: LimiterModel, driver: Driver, where: str) -> None:
    assert not driver.errors, driver.errors
    assert not driver.over_limit, driver.over_limit
    assert driver.holding == model.holders, (
        f"{where}: holders model {sorted(model.holders)} != actual {sorted(driver.holding)}"
    )
    assert limiter.in_flight == len(model.holders), (
        f"{where}: in_flight {limiter.in_flight} != model {len(model.holders)}"
    )
    assert limiter.queued == len(model.queue), (
        f"{where}: queued {limiter.queued} != model {model.queue}"
    )
    if limiter.queued:  # a permit is never left free while someone waits
        assert limiter.in_flight >= limiter.limit, f"{where}: queued while a permit is free"


async def _run_limiter_sequence(seed: int, adaptive: bool, backend: str) -> None:
    rng = random.Random(seed * 31 + adaptive)
    clock = VirtualClock()
    max_queued = rng.choice([0, 1, 3, 6])
    if adaptive:
        low, high = rng.choice([(1, 8), (2, 5), (1, 3)])
        initial = rng.randint(low, high)
        limiter: Any = AdaptiveConcurrencyLimiter(
            initial, low, high, max_queued=max_queued, clock=clock.clock
        )
    else:
        limiter = ConcurrencyLimiter(rng.randint(1, 4), max_queued=max_queued, clock=clock.clock)
    model = LimiterModel(limiter.limit, max_queued)
    step = 0

    def where() -> str:
        return f"seed={seed} backend={backend} adaptive={adaptive} step={step}"

    who = 0
    deadlines = 0
    async with anyio.create_task_group() as tg:
        driver = Driver(limiter, tg, where)
        for step in range(160):  # noqa: B007 - where() reports it
            clock.advance(rng.choice([0.0, 0.001, 0.005, 0.02, 0.1]))
            op = rng.random()
            before = limiter.limit
            if op < 0.4:  # a caller arrives
                who += 1
                expect = model.arrive(who)
                driver.spawn(who)
                await _settle()
                if expect == "refused":
                    assert driver.outcome.get(who) == "refused", f"{where()}: expected a refusal"
            elif op < 0.7 and model.holders:  # a holder ends its dispatch
                done = rng.choice(sorted(model.holders))
                model.holders.remove(done)
                if rng.random() < 0.15:
                    driver.time_out.add(done)  # the adaptive limit halves: permits owed
                driver.release[done].set()
                await _settle()
                if adaptive:
                    model.limit = limiter.limit
                model.fill()
            elif op < 0.8 and model.queue:  # a queued caller is cancelled
                gone = rng.choice(model.queue)
                model.queue.remove(gone)
                driver.scopes[gone].cancel()
                await _settle()
                assert driver.outcome.get(gone) == "cancelled", where()
            elif op < 0.88 and model.queue and model.holders:
                # a holder ends and the first in line is cancelled in the same step: the
                # permit handed to it goes on, never lost nor duplicated
                done = rng.choice(sorted(model.holders))
                first = model.queue[0]
                driver.release[done].set()
                driver.scopes[first].cancel()
                model.holders.remove(done)
                model.queue.remove(first)
                await _settle()
                if adaptive:
                    model.limit = limiter.limit
                model.fill()
                assert driver.outcome.get(first) in ("cancelled", "released"), where()
            elif op < 0.92:  # guard() never barges past the queue
                expect_ok = not model.queue and len(model.holders) < model.limit
                refusal: RetryableError | None = None
                try:
                    with limiter.guard():
                        assert expect_ok, f"{where()}: guard() admitted past the model"
                        assert limiter.in_flight <= limiter.limit, where()
                except RetryableError as error:
                    refusal = error
                if refusal is not None:
                    assert not expect_ok, f"{where()}: guard() refused: {refusal}"
                    assert refusal.reason is LIMITED, where()
                    assert refusal.effect is NOT_SENT, where()
                    driver.check_hint(refusal, "guard")
                await _settle()
                if adaptive:
                    model.limit = limiter.limit
                    model.fill()
            elif (
                op < 0.95
                and deadlines < 2
                and len(model.queue) < max_queued
                and (model.queue or len(model.holders) >= model.limit)
            ):
                # a caller with a short deadline queues and gives up before it (a tiny real
                # wait: the queue's deadline runs on the loop's clock)
                deadlines += 1
                who += 1
                driver.spawn(who, Request(name="kv.get", timeout=0.03))
                with anyio.fail_after(2):
                    await driver.done[who].wait()
                assert driver.outcome[who] == "refused", where()
                await _settle()
            else:  # a caller whose request has no time left is refused at once
                request = Request(name="kv.get", timeout=0.5, clock=clock.clock)
                clock.advance(0.5)
                who += 1
                if model.queue or len(model.holders) >= model.limit:
                    driver.spawn(who, request)
                    await _settle()
                    assert driver.outcome.get(who) == "refused", where()
                    continue
            if adaptive:
                assert limiter.min_limit <= limiter.limit <= limiter.max_limit, where()
                if limiter.limit != before:
                    model.limit = limiter.limit
                    model.fill()
            _check_limiter_state(limiter, model, driver, where())
        for holder in sorted(model.holders):  # the end: everyone drains
            driver.release[holder].set()
        while model.queue or model.holders:
            model.holders.clear()
            await _settle()
            model.limit = limiter.limit
            model.fill()
            for holder in sorted(model.holders):
                driver.release[holder].set()
            assert model.holders == driver.holding or not driver.holding, where()
        await _settle()
    assert (limiter.in_flight, limiter.queued) == (0, 0), where()
    assert not driver.errors, driver.errors
    assert not driver.over_limit, driver.over_limit
    assert len(set(driver.grants)) == len(driver.grants), f"{where()}: a caller granted twice"


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(6))
async def test_fixed_limiter_matches_the_fifo_model(seed: int) -> None:
    await _run_limiter_sequence(seed, False, sniffio.current_async_library())


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(6))
async def test_adaptive_limiter_matches_the_fifo_model(seed: int) -> None:
    await _run_limiter_sequence(seed, True, sniffio.current_async_library())


@pytest.mark.anyio
async def test_fifo_order_of_granted_waiters() -> None:
    limiter = ConcurrencyLimiter(2, max_queued=20)
    rng = random.Random(3)
    async with anyio.create_task_group() as tg:
        driver = Driver(limiter, tg, lambda: "fifo")
        for who in range(22):  # one at a time: arrival order is the spawn order
            driver.spawn(who)
            await _settle()
        cancelled = set(rng.sample(range(2, 22), 6))
        for who in cancelled:
            driver.scopes[who].cancel()
        await _settle()
        while len(driver.outcome) < 22:  # one permit back per turn: one grant at a time
            driver.release[min(driver.holding)].set()
            await _settle()
    expected = [w for w in range(22) if w not in cancelled]
    assert driver.grants == expected


class ThreadRun:
    """guard() from several threads: how many were inside at once, and any bad refusal."""

    def __init__(self, limiter: Any, clock: VirtualClock, cap: int) -> None:
        self.limiter = limiter
        self.clock = clock
        self.cap = cap
        self.lock = threading.Lock()
        self.inside = 0
        self.worst = 0
        self.refused = 0
        self.problems: list[str] = []

    def work(self, seed: int) -> None:
        rng = random.Random(seed)
        for i in range(400):
            try:
                with self.limiter.guard():
                    with self.lock:
                        self.inside += 1
                        self.worst = max(self.worst, self.inside)
                        if self.inside > self.cap:
                            self.problems.append(f"thread {seed} step {i}: {self.inside} inside")
                    self.clock.now += rng.choice([0.0, 0.001, 0.002])
                    if rng.random() < 0.3:
                        threading.Event().wait(0.0001)
                    with self.lock:
                        self.inside -= 1
            except RetryableError as error:
                with self.lock:
                    self.refused += 1
                if error.effect is not NOT_SENT or error.reason is not LIMITED:
                    self.problems.append(f"thread {seed} step {i}: bad refusal {error!r}")


@pytest.mark.parametrize("adaptive", [False, True])
def test_guard_from_threads_never_exceeds_the_limit(adaptive: bool) -> None:
    clock = VirtualClock()
    if adaptive:
        limiter: Any = AdaptiveConcurrencyLimiter(4, 2, 6, clock=clock.clock)
    else:
        limiter = ConcurrencyLimiter(4)
    run = ThreadRun(limiter, clock, limiter.max_limit if adaptive else limiter.limit)
    threads = [threading.Thread(target=run.work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not run.problems, run.problems[:5]
    assert run.worst > 1  # the threads did overlap
    assert (limiter.in_flight, limiter.queued) == (0, 0)
    if adaptive:
        assert limiter.min_limit <= limiter.limit <= limiter.max_limit


def test_refusal_retry_after_is_none_for_a_fixed_limit_and_the_rtt_for_an_adaptive_one() -> None:
    fixed = ConcurrencyLimiter(1)
    with fixed.guard(), pytest.raises(RetryableError) as caught, fixed.guard():
        pass
    assert caught.value.retry_after is None
    clock = VirtualClock()
    adaptive = AdaptiveConcurrencyLimiter(2, 1, 2, clock=clock.clock)
    _drive_adaptive(adaptive, clock, 0.0125, 30)  # windows of 0.0125 s round trips
    with adaptive.guard(), adaptive.guard(), pytest.raises(RetryableError) as caught:  # noqa: SIM117
        with adaptive.guard():
            pytest.fail("refused")
    assert caught.value.retry_after == pytest.approx(0.0125)
    assert caught.value.effect is NOT_SENT


def _drive_adaptive(
    limiter: AdaptiveConcurrencyLimiter, clock: VirtualClock, rtt: float, rounds: int
) -> list[int]:
    """Rounds of ``limit`` concurrent dispatches (sync guard()), each lasting ``rtt``."""
    limits = []
    for _ in range(rounds):
        n = limiter.limit
        permits = [limiter.guard() for _ in range(n)]
        for permit in permits:
            permit.__enter__()
        clock.advance(rtt)
        for permit in permits:
            permit.__exit__(None, None, None)
        assert limiter.min_limit <= limiter.limit <= limiter.max_limit
        assert limiter.in_flight == 0
        limits.append(limiter.limit)
    return limits


def test_adaptive_limit_grows_on_flat_latency_and_shrinks_when_it_rises() -> None:
    for seed in range(3):
        clock = VirtualClock()
        limiter = AdaptiveConcurrencyLimiter(10, 2, 60, clock=clock.clock)
        rtt = [0.01, 0.02, 0.05][seed]
        _drive_adaptive(limiter, clock, rtt, 400)  # flat latency at full use
        grown = limiter.limit
        assert grown > 10, f"seed={seed}: the limit did not grow ({grown})"
        limits = _drive_adaptive(limiter, clock, rtt * 4, 20)  # latency rises
        assert min(limits) < grown, f"seed={seed}: the limit did not shrink ({limits})"


@pytest.mark.anyio
async def test_adaptive_limit_changes_never_strand_queued_waiters() -> None:
    # flat latency lets the limit grow while callers wait: the new permits go to them
    clock = VirtualClock()
    limiter = AdaptiveConcurrencyLimiter(2, 1, 40, max_queued=100, clock=clock.clock)
    async with anyio.create_task_group() as tg:
        driver = Driver(limiter, tg, lambda: "strand")
        who = 0
        for step in range(150):
            while limiter.queued < 4:
                who += 1
                driver.spawn(who)
                await _settle()
            clock.advance(0.02)
            for holder in sorted(driver.holding):
                driver.release[holder].set()
            await _settle()
            assert limiter.min_limit <= limiter.limit <= limiter.max_limit
            if limiter.queued:
                assert limiter.in_flight >= limiter.limit, (
                    f"step {step}: {limiter.queued} queued with in_flight {limiter.in_flight} "
                    f"< limit {limiter.limit}"
                )
        assert limiter.limit > 2
        for scope in driver.scopes.values():
            scope.cancel()
        for event in driver.release.values():
            event.set()
    assert (limiter.in_flight, limiter.queued) == (0, 0)
    assert not driver.errors
    assert not driver.over_limit


# ============================================================================================
# LatencyQuantile
# ============================================================================================


class QuantileModel:
    """Every latency kept with its time; the delay recomputed when a slice turns over, and
    when the window first reaches min_samples (rfc/0009, "The window")."""

    def __init__(self, q: LatencyQuantile, start: float) -> None:
        self.extra = q.max_extra_load
        self.window = q.window.total_seconds()
        self.per_slice = 10 / self.window
        self.min_samples = q.min_samples
        self.low = q.min_delay.total_seconds()
        high = q.max_delay
        self.high = math.inf if high is None else high.total_seconds()
        self.events: list[tuple[float, float]] = []
        self.index = int(start * self.per_slice)
        self.basis: list[float] | None = None  # the latencies the delay was computed from

    def kept(self) -> list[float]:
        return [x for t, x in self.events if int(t * self.per_slice) > self.index - 10]

    def turn(self, now: float) -> None:
        index = int(now * self.per_slice)
        if index > self.index:
            self.index = index
            kept = self.kept()
            self.basis = kept if len(kept) >= self.min_samples else None

    def record(self, now: float, latency: float) -> None:
        self.turn(now)
        self.events.append((now, latency))
        if self.basis is None:
            kept = self.kept()
            if len(kept) >= self.min_samples:
                self.basis = kept

    def clamp(self, value: float) -> float:
        return min(max(value, self.low), self.high)

    def nearest_rank(self) -> float:
        assert self.basis is not None
        ordered = sorted(self.basis)
        n = len(ordered)
        above = math.floor(self.extra * n + 1e-9)
        return ordered[n - above - 1]


def _stream(rng: random.Random, kind: str, base: float) -> Callable[[], float]:
    if kind == "octave":  # within one octave: no gap, no tail logic
        return lambda: base * (1.0 + 0.95 * rng.random())
    if kind == "discrete":
        values = [base * (1.0 + 0.1 * i) for i in range(8)]
        return lambda: rng.choice(values)
    if kind == "constant":
        return lambda: base
    if kind == "bimodal":
        return lambda: base * (1 + rng.random()) * (40.0 if rng.random() < 0.012 else 1.0)
    return lambda: rng.expovariate(1 / base)  # "exponential"


@pytest.mark.parametrize("seed", range(10))
def test_latency_quantile_matches_the_nearest_rank(seed: int) -> None:
    rng = random.Random(seed + 100)
    kind = ["octave", "discrete", "constant", "octave", "discrete"][seed % 5]
    base = rng.choice([3e-6, 0.0004, 0.002, 0.05, 1.5])
    extra = rng.choice([0.01, 0.05, 0.2, 0.5])
    min_samples = rng.choice([1, 5, 50, 100])
    window = rng.choice([1.0, 2.0, 10.0])
    low = rng.choice([0.0, base * 1.2, 0.001])
    high = rng.choice([None, base * 1.5, 10.0])
    if high is not None and high < low:
        high = None
    clock = Clock(2000.0 + rng.randrange(64) / 64)
    q = LatencyQuantile(
        extra,
        window=window,
        min_delay=low,
        max_delay=high,
        min_samples=min_samples,
        clock=clock,
    )
    model = QuantileModel(q, clock.now)
    draw = _stream(rng, kind, base)
    for step in range(1500):
        where = (
            f"seed={seed} step={step} kind={kind} base={base} extra={extra} "
            f"min_samples={min_samples} window={window} min={low} max={high} t={clock.now}"
        )
        op = rng.random()
        if op < 0.08:
            clock.now += rng.choice([1 / 64, window / 10, window / 4, window]) * rng.choice([1, 2])
            clock.now = round(clock.now * 64) / 64
        elif op < 0.1:
            with pytest.raises((TypeError, ValueError), match=r"record\(latency\)"):
                q.record(rng.choice([-1.0, math.nan, math.inf, "1"]))  # type: ignore[arg-type]
        else:
            latency = draw()
            cut = q.delay_seconds > latency and rng.random() < 0.1  # a hedge the first beat
            q.record(latency, cut=cut)
            model.record(clock.now, latency)
        model.turn(clock.now)
        actual = q.current_delay
        if model.basis is None:
            assert actual is None, f"{where}: expected None (fewer than min_samples), got {actual}"
            continue
        assert actual is not None, f"{where}: expected a delay, model has {len(model.basis)}"
        delay = actual.total_seconds()
        exact = model.nearest_rank()
        lo, hi = model.clamp(exact), model.clamp(exact * (1 + RELATIVE_ERROR))
        assert lo - 1e-6 <= delay <= hi + 1e-6, (
            f"{where}: delay {delay} not within [{lo}, {hi}] (exact p{(1 - extra) * 100:g} "
            f"{exact} of {len(model.basis)})"
        )
        assert abs(q.delay_seconds - delay) <= 1e-6  # current_delay: a timedelta (us)
    assert len(q._pending) < _FOLD  # fixed memory: the waiting latencies are bounded


def _stay_bound(extra: float, n: int) -> int:
    """The most latencies rfc/0009 lets lie above the delay: k2, or the hysteresis a3."""
    k = math.floor(extra * n + 1e-9)
    share = math.floor(min(extra * 1.4, extra + 0.004) * n + 1e-9)
    k2 = max(share, math.floor(k + 2 * math.sqrt(k + 1)))
    a = math.floor((extra + 0.005) * n + 1e-9)
    return max(k2, math.floor(a + 2 * math.sqrt(a + 1)))


@pytest.mark.parametrize("seed", range(6))
def test_latency_quantile_tail_streams_stay_within_the_documented_bounds(seed: int) -> None:
    rng = random.Random(seed + 500)
    kind = ["bimodal", "exponential"][seed % 2]
    base = rng.choice([0.001, 0.004])
    extra = rng.choice([0.01, 0.02])
    clock = Clock(3000.0)
    q = LatencyQuantile(extra, window=10.0, min_delay=0.0, min_samples=100, clock=clock)
    model = QuantileModel(q, clock.now)
    draw = _stream(rng, kind, base)
    for step in range(2000):
        if rng.random() < 0.02:
            clock.now += 0.5
        latency = draw()
        q.record(latency)
        model.record(clock.now, latency)
        model.turn(clock.now)
        delay = q.delay_seconds
        if model.basis is None:
            assert delay == math.inf, f"seed={seed} step={step}"
            continue
        n = len(model.basis)
        above = sum(1 for x in model.basis if x > delay)
        bound = _stay_bound(extra, n)
        assert above <= bound, (
            f"seed={seed} step={step} {kind}: {above} of {n} above the delay {delay}, "
            f"documented at most {bound}"
        )
        top = max(model.basis) * (1 + RELATIVE_ERROR)
        assert delay <= top, f"seed={seed} step={step}: delay {delay} above every latency"


def test_latency_quantile_memory_stays_fixed() -> None:
    rng = random.Random(9)
    clock = Clock(100.0)
    q = LatencyQuantile(0.01, window=1.0, min_samples=10, clock=clock)
    for i in range(60_000):
        clock.now = 100.0 + i / 20_000
        q.record(rng.uniform(1e-7, 5000.0), cut=rng.random() < 0.05)
        if i % 5000 == 0:
            assert len(q._pending) <= _FOLD
            assert all(len(s) <= 2 * _CUT for s in q._slices)
    assert q.count <= 20_000
    assert sum(len(s) for s in q._slices) <= 10 * 2 * _CUT
