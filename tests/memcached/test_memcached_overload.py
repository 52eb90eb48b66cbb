"""Load shedding in the memcached example client, per server, on a real memcached.

The client's ``limiter=`` and ``throttle=`` guard each dispatch in rfc/0009's order
(throttle, limiter, breaker, send). A refusal is ``NOT_SENT``: even a SET is retried,
nothing reaches memcached for it, and no permit is left behind however the request
ends. Under 2x overload (the fault proxy serving a fixed capacity) the adaptive
limiter turns timeouts of sent requests into answers, and the SRE throttle bounds the
attempts sent per accepted one. The assertions are qualitative (no timings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    BestEffortRetryStrategy,
    FailFastRetryStrategy,
    RequestCanceledException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
)
from sdkcore._adaptive_limiter import AdaptiveConcurrencyLimiter
from sdkcore._limiter import ConcurrencyLimiter
from sdkcore._permits import LIMITED
from sdkcore._throttle import REFUSAL_REASON, AdaptiveThrottle
from sdkcore.examples.memcached import MemcachedClient
from sdkcore.mapping import KvOpcode

pytestmark = pytest.mark.anyio

LIMITERS: dict[str, Callable[[], Any]] = {
    "fixed": lambda: ConcurrencyLimiter(1, name="m"),
    "adaptive": lambda: AdaptiveConcurrencyLimiter(1, 1, 1, name="m"),
}


@pytest.mark.parametrize("kind", list(LIMITERS))
async def test_a_limiter_refusal_is_not_sent_and_retried_even_for_a_set(
    memcached: Memcached, proxy: FaultProxy, kind: str
) -> None:
    limiter = LIMITERS[kind]()
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=RetryOrchestrator(BestEffortRetryStrategy()),
        timeout=5.0,
        limiter=limiter,
    ) as client:
        assert client.limiters == [limiter]
        await client.set("k", b"v")
        proxy.delay = 0.2  # the GET holds the only permit while the SET arrives
        proxy.reset_counts()
        sets: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.get, "k")
            await anyio.sleep(0.05)

            async def store() -> None:
                sets.append(await client.set("k", b"w"))

            tg.start_soon(store)
        proxy.delay = 0.0
        _, _, requests = proxy.counts()
        # one GET and one SET reached memcached: the refused SET attempts sent nothing
        assert requests == {KvOpcode.GET: 1, KvOpcode.SET: 1}
        assert len(sets) == 1
        assert await client.get("k") == b"w"
    assert limiter.in_flight == 0
    assert limiter.queued == 0


async def test_a_refused_set_that_never_gets_a_permit_times_out_unsent(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    limiter = ConcurrencyLimiter(1, name="m")
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=RetryOrchestrator(BestEffortRetryStrategy()),
        timeout=0.3,
        limiter=limiter,
    ) as client:
        await client.set("k", b"v")
        proxy.reset_counts()
        # the only permit is held elsewhere until the SET's deadline
        with limiter.guard(), pytest.raises(TimeoutException) as caught:
            await client.set("k", b"w")
        _, _, requests = proxy.counts()
        assert requests == {}  # nothing reached memcached: the timeout is unambiguous
        context = caught.value.context
        assert context is not None
        assert LIMITED in context.retry_reasons
        assert context.retry_attempts >= 1
        assert not context.in_flight
        assert await client.get("k") == b"v"
    assert limiter.in_flight == 0
    assert limiter.queued == 0


@pytest.mark.parametrize("kind", list(LIMITERS))
async def test_no_permit_leaks_when_requests_are_cancelled_in_flight_and_queued(
    memcached: Memcached, proxy: FaultProxy, kind: str
) -> None:
    if kind == "fixed":
        limiter: Any = ConcurrencyLimiter(1, max_queued=8, name="m")
    else:
        limiter = LIMITERS[kind]()
    async with MemcachedClient(f"127.0.0.1:{proxy.port}", timeout=5.0, limiter=limiter) as client:
        await client.set("k", b"v")
        proxy.delay = 0.5
        with anyio.move_on_after(0.2):
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(client.get, "k")
        assert limiter.in_flight == 0
        assert limiter.queued == 0
        proxy.delay = 0.0
        assert await client.get("k") == b"v"
    assert limiter.in_flight == 0
    assert limiter.queued == 0


async def test_a_throttle_refusal_is_not_sent_and_retried(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    draws: list[float] = []  # queued draws, then 0.99: admit

    def draw() -> float:
        return draws.pop(0) if draws else 0.99

    throttle = AdaptiveThrottle(2.0, name="m", random=draw)
    for _ in range(10):  # ten TMPFAIL answers: the throttle refuses with p = 10/11
        with pytest.raises(RetryableError), throttle.guard():
            raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "tmpfail")
    assert throttle.rejection_probability > 0.5
    draws.append(0.0)  # armed after the set-up: the client's first admission is refused
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=RetryOrchestrator(BestEffortRetryStrategy()),
        timeout=5.0,
        throttle=throttle,
    ) as client:
        assert client.throttles == [throttle]
        proxy.reset_counts()
        await client.set("k", b"v")
        _, _, requests = proxy.counts()
        assert requests == {KvOpcode.SET: 1}  # the refused attempt sent nothing
        assert draws == []  # ... and it was refused: the SET was retried
        assert await client.get("k") == b"v"


async def test_tmpfail_answers_count_as_rejections_and_the_throttle_sheds(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    throttle = AdaptiveThrottle(2.0, name="m", random=lambda: 0.0)
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=RetryOrchestrator(BestEffortRetryStrategy()),
        timeout=0.3,
        throttle=throttle,
    ) as client:
        await client.set("k", b"v")
        proxy.limit_capacity(1, 0.0, reject=True)
        proxy.capacity = 0  # every request is answered TMPFAIL
        proxy.reset_counts()
        with pytest.raises(TimeoutException) as caught:
            await client.get("k")
        _, _, requests = proxy.counts()
        assert proxy.rejected == requests.get(KvOpcode.GET, 0) >= 1
        assert caught.value.context is not None
        assert RetryReason.KV_TEMPORARY_FAILURE in caught.value.context.retry_reasons
        assert REFUSAL_REASON in caught.value.context.retry_reasons  # then refused locally
        assert throttle.rejection_probability > 0


def test_a_limiter_object_serves_one_endpoint_only_and_the_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"MemcachedClient\(limiter\).*callable"):
        MemcachedClient(["127.0.0.1:1", "127.0.0.1:2"], limiter=ConcurrencyLimiter(1))
    with pytest.raises(TypeError, match=r"MemcachedClient\(throttle\) must be"):
        MemcachedClient("127.0.0.1:1", throttle=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"MemcachedClient\(limiter\) made"):
        MemcachedClient("127.0.0.1:1", limiter=lambda name: None)  # type: ignore[arg-type,return-value]
    client = MemcachedClient(
        ["127.0.0.1:1", "127.0.0.1:2"],
        limiter=lambda name: ConcurrencyLimiter(2, name=name),
        throttle=lambda name: AdaptiveThrottle(name=name),
    )
    assert [limiter.name for limiter in client.limiters if limiter] == [
        "127.0.0.1:1",
        "127.0.0.1:2",
    ]
    assert len({id(t) for t in client.throttles}) == 2


# -- 2x overload on a server of fixed capacity (qualitative outcomes, no timings) ----------

CAPACITY = 2  # requests in service at a time
SERVICE = 0.01  # seconds each: the server answers 200 requests/s
TIMEOUT = 0.1  # ten service times


async def overload(
    proxy: FaultProxy,
    seconds: float,
    strategy: Any = None,
    request_timeout: float = TIMEOUT,
    **guards: Any,
) -> tuple[dict[str, Any], MemcachedClient]:
    """GETs open loop at twice the capacity for ``seconds``; outcomes counted, and
    ``over``: the most a request ran past its deadline (seconds)."""
    outcomes: dict[str, Any] = {"ok": 0, "cut": 0, "late": 0, "over": 0.0}
    rate = 2 * CAPACITY / SERVICE
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=RetryOrchestrator(strategy or BestEffortRetryStrategy()),
        timeout=request_timeout,
        **guards,
    ) as client:
        await client.set("k", b"v")
        proxy.reset_counts()

        async def one() -> None:
            began = anyio.current_time()
            try:
                await client.get("k")
            except TimeoutException as exc:
                cut = exc.context is not None and exc.context.in_flight
                outcomes["cut" if cut else "late"] += 1
            except RequestCanceledException:  # a refusal failed fast (FailFast)
                outcomes["late"] += 1
            else:
                outcomes["ok"] += 1
            over = anyio.current_time() - began - request_timeout
            outcomes["over"] = max(outcomes["over"], over)

        sent = 0
        async with anyio.create_task_group() as tg:
            start = anyio.current_time()
            while (now := anyio.current_time()) < start + seconds:
                while sent < int((now - start) * rate) + 1:
                    tg.start_soon(one)
                    sent += 1
                await anyio.sleep(1 / rate)
    return outcomes, client


async def test_under_2x_load_the_adaptive_limiter_answers_more_and_cuts_fewer(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    proxy.limit_capacity(CAPACITY, SERVICE)
    without, _ = await overload(proxy, 2.0)
    proxy.limit_capacity(CAPACITY, SERVICE)  # drops what the first run left queued
    limiter = AdaptiveConcurrencyLimiter(1, name="m")
    with_limiter, client = await overload(proxy, 2.0, limiter=limiter)
    # without a limiter the queue outgrows the timeout: most requests are cut in flight
    # (sent, unanswered: the server did the work for nothing); the limiter keeps the queue
    # short, so what is sent is answered and the rest is refused before it is sent
    assert with_limiter["ok"] > 2 * without["ok"], (without, with_limiter)
    assert with_limiter["cut"] < without["cut"] + without["late"], (without, with_limiter)
    assert client.limiters == [limiter]
    assert limiter.in_flight == 0
    assert limiter.queued == 0


async def test_the_default_adaptive_limiter_sheds_to_what_the_server_serves(
    memcached: Memcached, proxy: FaultProxy, gc_pauses: list[tuple[float, float]]
) -> None:
    """Issue 23, item 6, qualitatively, with the defaults (initial limit 20: ten times
    what the server takes) and refusals failing fast, as bench/bench_overload.py's row
    that sheds: once it has learned the endpoint, most of what the server can serve is
    answered, fewer are cut in flight, and no request waits past its deadline. The
    timeout is the bench's main row (25 service times): at 10, the first 20 let in queue
    a whole timeout deep, and the example client's breaker may open on those cuts while
    the limiter learns (bench/README, "bench_overload.py", `--timeout-x 10`)."""
    timeout = 25 * SERVICE
    proxy.limit_capacity(CAPACITY, SERVICE)
    without, _ = await overload(proxy, 3.0, FailFastRetryStrategy(), timeout)
    proxy.limit_capacity(CAPACITY, SERVICE)
    limiter = AdaptiveConcurrencyLimiter(name="m")
    shed, _ = await overload(proxy, 3.0, FailFastRetryStrategy(), timeout, limiter=limiter)
    assert shed["ok"] > 2 * without["ok"], (without, shed)
    assert shed["ok"] >= 0.5 * 3.0 * CAPACITY / SERVICE, shed  # half of capacity, learning included
    assert shed["cut"] < without["cut"], (without, shed)
    # past its deadline: only the loop's own lateness (bench: 1.4 ms at most), generous
    # here for a loaded machine, and garbage collections left out
    assert shed["over"] <= 0.05 + sum(end - start for start, end in gc_pauses), shed
    assert limiter.in_flight == 0


async def test_against_a_server_answering_tmpfail_the_throttle_bounds_attempts_per_accept(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    def frames_per_served(throttle: AdaptiveThrottle | None) -> float:
        _, _, requests = proxy.counts()
        return sum(requests.values()) / max(proxy.served, 1)

    proxy.limit_capacity(CAPACITY, SERVICE, reject=True)
    await overload(proxy, 2.0)
    without = frames_per_served(None)
    proxy.limit_capacity(CAPACITY, SERVICE, reject=True)
    throttle = AdaptiveThrottle(2.0, window=1.0, name="m")
    await overload(proxy, 2.0, throttle=throttle)
    with_throttle = frames_per_served(throttle)
    # BestEffort re-sends every TMPFAIL: several frames per accepted request; the
    # throttle keeps what is sent near K = 2 per accept (the SRE bound), with slack
    assert with_throttle < without, (without, with_throttle)
    assert with_throttle <= 2.0 + 1.0, (without, with_throttle)
