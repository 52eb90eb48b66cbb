"""Load shedding in the blocking memcached example client, per server, on a real memcached.

``SyncMemcachedClient(limiter=..., throttle=...)`` guards each dispatch in rfc/0009's
order (throttle, limiter, connection, breaker, send) with the limiters' synchronous
``guard()``. A refusal is ``NOT_SENT``: even a SET is retried and nothing reaches
memcached for it; no permit is left behind however the attempt ends (an answer, an
error, a timeout, ``KeyboardInterrupt``); a throttle counts TMPFAIL answers as
rejections; and threads sharing one client never have more dispatches in flight than
the limit. The assertions are about behaviour, never about timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    BestEffortRetryStrategy,
    DocumentNotFoundException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
)
from sdkcore._adaptive_limiter import AdaptiveConcurrencyLimiter
from sdkcore._limiter import ConcurrencyLimiter
from sdkcore._permits import LIMITED
from sdkcore._throttle import REFUSAL_REASON, AdaptiveThrottle
from sdkcore.examples.memcached import SyncMemcachedClient
from sdkcore.mapping import KvOpcode
from sdkcore.testing import capture_retry_events

#: How long a test waits for something another thread does before it fails (never reached
#: when the behaviour is there; no assertion is about time).
PATIENCE = 10.0

LIMITERS: dict[str, Callable[[int], Any]] = {
    "fixed": lambda n: ConcurrencyLimiter(n, name="m"),
    "adaptive": lambda n: AdaptiveConcurrencyLimiter(n, 1, n, name="m"),
}


def _best_effort() -> RetryOrchestrator:
    # short, capped backoff: refused attempts come back quickly
    return RetryOrchestrator(BestEffortRetryStrategy(lambda n: min(0.001 * 2**n, 0.02)))


def _scheduled(events: list[Any], reason: RetryReason) -> int:
    return sum(
        1 for e in list(events) if e["event"] == "retry.scheduled" and e["reason"] == reason.name
    )


def _wait_for(predicate: Callable[[], bool]) -> None:
    give_up = time.monotonic() + PATIENCE
    while not predicate():
        assert time.monotonic() < give_up, "the other thread never got there"
        time.sleep(0.002)


class _Worker(threading.Thread):
    """Runs ``fn`` in a thread with sdkcore's events captured; keeps its result or error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.events: list[Any] = []
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        with capture_retry_events() as events:
            self.events = events
            try:
                self.result = self.fn()
            except BaseException as exc:
                self.error = exc

    def outcome(self) -> Any:
        self.join(PATIENCE)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def sync_client(proxy: FaultProxy) -> Iterator[Callable[..., SyncMemcachedClient]]:
    made: list[SyncMemcachedClient] = []

    def make(**kwargs: Any) -> SyncMemcachedClient:
        kwargs.setdefault("orchestrator", _best_effort())
        kwargs.setdefault("timeout", 5.0)
        client = SyncMemcachedClient(f"127.0.0.1:{proxy.port}", **kwargs)
        made.append(client)
        return client

    try:
        yield make
    finally:
        for client in made:
            client.close()


@pytest.mark.parametrize("kind", list(LIMITERS))
def test_a_limiter_refusal_is_not_sent_retried_and_counted_even_for_a_set(
    memcached: Memcached,
    proxy: FaultProxy,
    sync_client: Callable[..., SyncMemcachedClient],
    kind: str,
) -> None:
    limiter = LIMITERS[kind](1)
    client = sync_client(limiter=limiter)
    assert client.limiters == [limiter]
    client.set("k", b"v")
    assert limiter.in_flight == 0
    proxy.reset_counts()
    with limiter.guard():  # the only permit is held elsewhere while the SET starts
        worker = _Worker(lambda: client.set("k", b"w"))
        worker.start()
        _wait_for(lambda: _scheduled(worker.events, LIMITED) >= 2)
        _, _, requests = proxy.counts()
        assert requests == {}  # refused twice: nothing reached memcached
    assert isinstance(worker.outcome(), int)  # then it got the permit and was sent once
    _, _, requests = proxy.counts()
    assert requests == {KvOpcode.SET: 1}
    assert client.get("k") == b"w"
    assert limiter.in_flight == 0


def test_a_set_refused_until_its_deadline_times_out_unsent(
    memcached: Memcached, proxy: FaultProxy, sync_client: Callable[..., SyncMemcachedClient]
) -> None:
    limiter = ConcurrencyLimiter(1, name="m")
    client = sync_client(limiter=limiter, timeout=0.3)
    client.set("k", b"v")
    proxy.reset_counts()
    with limiter.guard(), pytest.raises(TimeoutException) as caught:
        client.set("k", b"w")
    _, _, requests = proxy.counts()
    assert requests == {}  # the timeout is unambiguous: nothing was sent
    context = caught.value.context
    assert context is not None
    assert LIMITED in context.retry_reasons
    assert context.retry_attempts >= 1
    assert not context.in_flight
    assert limiter.in_flight == 0
    assert client.get("k") == b"v"
    assert limiter.in_flight == 0


@pytest.mark.parametrize("kind", list(LIMITERS))
def test_the_permit_comes_back_after_answers_errors_timeouts_and_interrupts(
    memcached: Memcached,
    proxy: FaultProxy,
    sync_client: Callable[..., SyncMemcachedClient],
    kind: str,
) -> None:
    limiter = LIMITERS[kind](1)
    throttle = AdaptiveThrottle(name="m")
    client = sync_client(limiter=limiter, throttle=throttle, timeout=0.3)
    client.set("k", b"v")  # an answer
    assert client.get("k") == b"v"
    assert limiter.in_flight == 0
    with pytest.raises(DocumentNotFoundException):  # an error the server answered with
        client.get("missing")
    assert limiter.in_flight == 0
    proxy.drop_replies = True  # no answer: every attempt times out in flight
    with pytest.raises(TimeoutException):
        client.get("k")
    proxy.drop_replies = False
    assert limiter.in_flight == 0
    sent = throttle.requests

    endpoint = client._endpoints[0]
    dispatch = endpoint.dispatch

    def interrupted(*args: Any) -> Any:
        assert limiter.in_flight == 1  # held while the dispatch runs
        raise KeyboardInterrupt

    endpoint.dispatch = interrupted  # type: ignore[method-assign,assignment]
    with pytest.raises(KeyboardInterrupt):
        client.get("k")
    assert limiter.in_flight == 0
    assert throttle.requests == sent  # an interrupt is no outcome for the throttle
    endpoint.dispatch = dispatch  # type: ignore[method-assign]
    assert client.get("k") == b"v"
    assert limiter.in_flight == 0


def test_a_throttle_refusal_is_not_sent_and_retried(
    memcached: Memcached, proxy: FaultProxy, sync_client: Callable[..., SyncMemcachedClient]
) -> None:
    armed = [0]  # draws that refuse (0.0) before the others admit (0.99)

    def draw() -> float:
        if armed[0]:
            armed[0] -= 1
            return 0.0
        return 0.99

    throttle = AdaptiveThrottle(2.0, name="m", random=draw)
    for _ in range(10):  # ten TMPFAIL answers: the throttle refuses with p = 10/11
        with pytest.raises(RetryableError), throttle.guard():
            raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "tmpfail")
    assert throttle.refused == 0
    armed[0] = 1  # refuse the SET's first attempt, then admit
    client = sync_client(throttle=throttle)
    assert client.throttles == [throttle]
    assert client.limiters == [None]
    proxy.reset_counts()
    with capture_retry_events() as events:
        client.set("k", b"v")
    assert _scheduled(events, REFUSAL_REASON) == 1
    _, _, requests = proxy.counts()
    assert requests == {KvOpcode.SET: 1}  # the refused attempt sent nothing
    assert throttle.refused == 1
    assert client.get("k") == b"v"


def test_tmpfail_answers_count_as_rejections_and_the_throttle_sheds(
    memcached: Memcached, proxy: FaultProxy, sync_client: Callable[..., SyncMemcachedClient]
) -> None:
    throttle = AdaptiveThrottle(2.0, name="m", random=lambda: 0.0)
    limiter = ConcurrencyLimiter(1, name="m")
    client = sync_client(throttle=throttle, limiter=limiter, timeout=0.3)
    client.set("k", b"v")
    assert (throttle.requests, throttle.accepts) == (1, 1)
    proxy.limit_capacity(1, 0.0, reject=True)
    proxy.capacity = 0  # every request is answered TMPFAIL
    proxy.reset_counts()
    with pytest.raises(TimeoutException) as caught:
        client.get("k")
    _, _, requests = proxy.counts()
    sent = requests.get(KvOpcode.GET, 0)
    assert proxy.rejected == sent >= 1
    context = caught.value.context
    assert context is not None
    assert RetryReason.KV_TEMPORARY_FAILURE in context.retry_reasons
    assert REFUSAL_REASON in context.retry_reasons  # then refused locally
    assert throttle.rejection_probability > 0
    assert throttle.refused >= 1
    # the TMPFAIL answers and the local refusals are requests without an accept
    assert throttle.requests - throttle.accepts >= 1 + throttle.refused
    assert limiter.in_flight == 0


@pytest.mark.parametrize("kind", list(LIMITERS))
def test_32_threads_sharing_a_client_never_exceed_the_limit(
    memcached: Memcached,
    proxy: FaultProxy,
    sync_client: Callable[..., SyncMemcachedClient],
    kind: str,
) -> None:
    limit, threads, each = 3, 32, 10
    limiter = LIMITERS[kind](limit)
    throttle = AdaptiveThrottle(name="m")
    client = sync_client(limiter=limiter, throttle=throttle, timeout=PATIENCE)
    client.set("k", b"v")
    proxy.reset_counts()
    sent_before = throttle.requests
    proxy.delay = 0.001  # each answer takes a moment: dispatches pile up behind the limit

    endpoint = client._endpoints[0]
    dispatch = endpoint.dispatch
    lock = threading.Lock()
    inside = 0
    most = 0

    def counted(*args: Any) -> Any:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        try:
            return dispatch(*args)
        finally:
            with lock:
                inside -= 1

    endpoint.dispatch = counted  # type: ignore[method-assign,assignment]

    def load(i: int) -> int:
        done = 0
        for j in range(each):
            if j % 2:
                client.set(f"k{i}", b"%d" % j)
            else:
                assert client.get("k") == b"v"
            done += 1
        return done

    start = threading.Barrier(threads)
    workers = [_Worker(lambda i=i: (start.wait(), load(i))[1]) for i in range(threads)]  # type: ignore[misc]
    for worker in workers:
        worker.start()
    done = sum(worker.outcome() for worker in workers)
    proxy.delay = 0.0
    assert done == threads * each
    assert 1 <= most <= limit  # never more dispatches in flight than the limit
    assert limiter.in_flight == 0
    refused = sum(_scheduled(worker.events, LIMITED) for worker in workers)
    assert refused > 0  # the limit was reached, and refusals were retried
    # The throttle (outside the limiter) counted what reached memcached, not the refusals.
    _, _, requests = proxy.counts()
    assert sum(requests.values()) == done
    assert throttle.requests - sent_before == done
    assert throttle.rejection_probability == 0.0


def test_a_guard_object_serves_one_endpoint_only_and_the_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"SyncMemcachedClient\(limiter\).*callable"):
        SyncMemcachedClient(["127.0.0.1:1", "127.0.0.1:2"], limiter=ConcurrencyLimiter(1))
    with pytest.raises(ValueError, match=r"SyncMemcachedClient\(throttle\).*callable"):
        SyncMemcachedClient(["127.0.0.1:1", "127.0.0.1:2"], throttle=AdaptiveThrottle())
    with pytest.raises(TypeError, match=r"SyncMemcachedClient\(throttle\) must be"):
        SyncMemcachedClient("127.0.0.1:1", throttle=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SyncMemcachedClient\(limiter\) must be"):
        SyncMemcachedClient("127.0.0.1:1", limiter=AdaptiveThrottle())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SyncMemcachedClient\(limiter\) made"):
        SyncMemcachedClient("127.0.0.1:1", limiter=lambda name: None)  # type: ignore[arg-type,return-value]
    client = SyncMemcachedClient(
        ["127.0.0.1:1", "127.0.0.1:2"],
        limiter=lambda name: AdaptiveConcurrencyLimiter(name=name),
        throttle=lambda name: AdaptiveThrottle(name=name),
    )
    assert [limiter.name for limiter in client.limiters if limiter] == [
        "127.0.0.1:1",
        "127.0.0.1:2",
    ]
    assert [throttle.name for throttle in client.throttles if throttle] == [
        "127.0.0.1:1",
        "127.0.0.1:2",
    ]
    assert SyncMemcachedClient("127.0.0.1:1").limiters == [None]
