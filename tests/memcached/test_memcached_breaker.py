"""A breaker per endpoint on a real memcached: kill it, count the probes, restart it.

The fault proxy in front of memcached counts every connection and request frame
that reaches the endpoint; while memcached is dead each dispatch is one connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    CouchbaseException,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
)
from sdkcore.examples.memcached import MemcachedClient, SyncMemcachedClient, endpoint_down
from sdkcore.mapping import KvOpcode
from sdkcore.testing import capture_retry_events

pytestmark = pytest.mark.anyio

SLEEP_WINDOW = 0.25
OUTAGE = 1.5  # how long the load runs against the dead endpoint after the trip


def breaker_factory(**overrides: Any) -> Callable[[str], CircuitBreaker]:
    settings: dict[str, Any] = {
        "volume_threshold": 5,
        "error_threshold_percentage": 50,
        "sleep_window": SLEEP_WINDOW,
        "canary_timeout": 0.5,
        "rolling_window": 30.0,
        "is_failure": endpoint_down,
    }
    settings.update(overrides)
    return lambda name: CircuitBreaker(name=name, **settings)


async def wait_for(predicate: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    with anyio.fail_after(limit):  # a safety net, not a timing claim
        while not predicate():  # noqa: ASYNC110 - polls the breaker's lazy state
            await anyio.sleep(0.01)


async def test_dead_endpoint_sees_one_probe_per_sleep_window_and_the_canary_closes(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    failures: list[CouchbaseException] = []
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=orchestrator,
        timeout=0.4,
        breaker=breaker_factory(),
    ) as client:
        breaker = client.breakers[0]
        await client.set("k", b"v")
        assert await client.get("k") == b"v"

        stop = anyio.Event()

        async def load() -> None:
            while not stop.is_set():
                try:
                    await client.get("k")
                except CouchbaseException as exc:
                    failures.append(exc)
                await anyio.sleep(0.005)

        with capture_retry_events() as events:
            memcached.kill()
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(load)
                await wait_for(lambda: breaker.state is not CircuitState.CLOSED, "the trip")
                proxy.reset_counts()
                started = time.monotonic()
                await anyio.sleep(OUTAGE)
                connections, refused, requests = proxy.counts()
                elapsed = time.monotonic() - started
                during_outage = list(failures)
                # restart: the next probe is a NOOP, and its answer closes the breaker
                await anyio.to_thread.run_sync(memcached.start)
                await wait_for(lambda: breaker.state is CircuitState.CLOSED, "the close")
                stop.set()
            _, _, after_restart = proxy.counts()

        # at most one probe per sleep window reached the dead endpoint (plus one dispatch
        # that may have been let through just before the trip)
        windows = elapsed / SLEEP_WINDOW
        assert 1 <= connections <= int(windows) + 2, (connections, windows)
        assert refused == connections
        # what reached the dead endpoint: the NOOP probes (and at most a dispatch or two
        # let through just before the trip)
        assert set(requests) <= {KvOpcode.NOOP, KvOpcode.GET}
        assert 1 <= requests.get(KvOpcode.NOOP, 0) <= int(windows) + 1
        assert sum(requests.values()) <= int(windows) + 2
        assert after_restart.get(KvOpcode.NOOP, 0) >= 1
        await client.set("k", b"again")  # memcached restarted empty
        assert await client.get("k") == b"again"
    names = [(e["event"], e.get("cause")) for e in events if e["event"].startswith("breaker.")]
    assert names[0] == ("breaker.opened", "threshold")
    assert ("breaker.opened", "probe_failed") in names
    assert names[-1] == ("breaker.closed", "probe_succeeded")
    assert all(e["endpoint"] == f"127.0.0.1:{proxy.port}" for e in events if "endpoint" in e)
    refused_by_breaker = [
        exc
        for exc in failures
        if exc.context is not None and RetryReason.CIRCUIT_BREAKER_OPEN in exc.context.retry_reasons
    ]
    assert refused_by_breaker, "requests during the outage were refused by the breaker"
    assert all(isinstance(exc, TimeoutException) for exc in during_outage)
    # A request whose dispatch was the failed probe reads as a refusal (nothing was sent),
    # not as its own connection failing in flight.
    canary = [
        e
        for e in events
        if e["event"].startswith("retry.") and "NOOP canary" in str(e.get("caused_by"))
    ]
    assert canary, "no request saw a failed canary"
    assert all(
        e["caused_by"].startswith("RetryableError: CIRCUIT_BREAKER_OPEN: the NOOP canary")
        and e["caused_by"].endswith("nothing was sent")
        for e in canary
    ), canary[0]


async def test_timeouts_open_the_default_breaker_and_a_slow_canary_counts_as_failed(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    # Couchbase's rule (timeouts only): a black-holed endpoint trips the breaker
    factory = breaker_factory(is_failure=None, volume_threshold=3, canary_timeout=0.1)
    async with MemcachedClient(f"127.0.0.1:{proxy.port}", timeout=0.15, breaker=factory) as client:
        breaker = client.breakers[0]
        await client.set("k", b"v")
        proxy.drop_replies = True
        for _ in range(3):
            with pytest.raises(TimeoutException):
                await client.get("k")
        assert breaker.state is CircuitState.OPEN
        await anyio.sleep(SLEEP_WINDOW)
        proxy.reset_counts()
        with pytest.raises(TimeoutException) as caught:
            await client.get("k")  # the probe: a NOOP that gets no answer
        assert breaker.state is CircuitState.OPEN
        _, _, requests = proxy.counts()
        assert requests.get(KvOpcode.NOOP) == 1
        assert requests.get(KvOpcode.GET, 0) == 0  # the user's GET never went out
        assert caught.value.context is not None
        # the next probe is due past the deadline: the request ends at once, naming it
        assert caught.value.context.reason is RetryReason.CIRCUIT_BREAKER_OPEN
        assert "may go only in" in caught.value.message
        proxy.drop_replies = False
        await wait_for(lambda: breaker.probe_after() == 0.0, "the next sleep window")
        assert await client.get("k") == b"v"  # NOOP answered: closed, then the GET
        assert breaker.state is CircuitState.CLOSED  # type: ignore[comparison-overlap]  # stale narrowing


def test_sync_door_breaker_opens_and_the_canary_closes(memcached: Memcached) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    with SyncMemcachedClient(
        memcached.address, orchestrator=orchestrator, timeout=0.3, breaker=breaker_factory()
    ) as client:
        breaker = client.breakers[0]
        client.set("k", b"v")
        memcached.kill()
        errors: list[CouchbaseException] = []
        for _ in range(10):
            try:
                client.get("k")
            except CouchbaseException as exc:
                errors.append(exc)
        assert breaker.state is not CircuitState.CLOSED
        assert len(errors) == 10
        assert any(
            e.context is not None and RetryReason.CIRCUIT_BREAKER_OPEN in e.context.retry_reasons
            for e in errors
        )
        memcached.start()
        deadline = time.monotonic() + 10  # a safety net
        while breaker.state is not CircuitState.CLOSED and time.monotonic() < deadline:  # type: ignore[comparison-overlap]  # stale narrowing
            try:
                client.set("k", b"back")
            except CouchbaseException:
                time.sleep(0.01)
        assert breaker.state is CircuitState.CLOSED  # type: ignore[comparison-overlap]  # stale narrowing
        assert client.get("k") == b"back"


async def test_one_reset_with_many_requests_in_flight_is_one_failure(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """A memcached SDK maintainer's review: each request the reset failed counted as a
    failure of its own, so one reset of a healthy server with 30 GETs out opened the
    breaker (volume 5, 50%), their retries were refused, and the endpoint was cut off for
    the sleep window. A lost connection that had answered is one failure now; the GETs
    retry and pass."""
    factory = breaker_factory(sleep_window=5.0)
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=RetryOrchestrator(BestEffortRetryStrategy()),
        timeout=5.0,
        breaker=factory,
    ) as client:
        breaker = client.breakers[0]
        await client.set("k", b"v")
        proxy.delay = 0.5  # replies held (one after another): the GETs below are all in flight
        results: list[Any] = []

        async def get() -> None:
            results.append(await client.get("k"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(30):
                    tg.start_soon(get)
                await wait_for(lambda: proxy.counts()[2].get(int(KvOpcode.GET), 0) >= 30, "30 out")
                proxy.delay = 0.0
                proxy.cut_all()  # one reset; memcached stays up
        assert len(results) == 30
        assert all(r == b"v" for r in results)
        assert breaker.state is CircuitState.CLOSED


def test_sync_canary_interrupted_frees_the_probe(memcached: Memcached) -> None:
    """Ctrl-C while the sync client's NOOP canary waits: no outcome, and the probe is free
    again for the next dispatch (rfc/0007), as the async client's cut canary. Held, every
    thread's request was refused CIRCUIT_BREAKER_OPEN until canary_timeout, then the
    breaker reopened for a probe that never ended."""
    opened = breaker_factory(volume_threshold=1, canary_timeout=30.0)
    with SyncMemcachedClient(memcached.address, timeout=2.0, breaker=opened) as client:
        breaker = client.breakers[0]
        client.set("k", b"v")
        breaker.record_failure(TimeoutError("earlier timeouts"))
        assert breaker.state is CircuitState.OPEN
        time.sleep(SLEEP_WINDOW * 1.5)  # the next dispatch is the probe
        endpoint = client._endpoints[0]
        roundtrip = endpoint._roundtrip

        def interrupted(*args: Any) -> Any:
            endpoint._roundtrip = roundtrip  # type: ignore[method-assign]
            raise KeyboardInterrupt  # as the canary waits for its answer

        endpoint._roundtrip = interrupted  # type: ignore[method-assign,assignment]
        with pytest.raises(KeyboardInterrupt):
            client.get("k")
        assert breaker.state is CircuitState.HALF_OPEN  # type: ignore[comparison-overlap]  # stale narrowing
        assert client.get("k") == b"v"  # the probe went (not refused for 30 s) and closed it
        assert breaker.state is CircuitState.CLOSED


def test_sync_canary_failing_with_a_client_error_does_not_close_the_breaker(
    memcached: Memcached,
) -> None:
    """Only the caller's interrupt is reported as no outcome: an error of the client's own
    (a reply it could not decode) reaches the caller and is no success of the probe's."""
    opened = breaker_factory(volume_threshold=1)
    with SyncMemcachedClient(memcached.address, timeout=2.0, breaker=opened) as client:
        breaker = client.breakers[0]
        client.set("k", b"v")
        breaker.record_failure(TimeoutError("earlier timeouts"))
        time.sleep(SLEEP_WINDOW * 1.5)
        endpoint = client._endpoints[0]
        roundtrip = endpoint._roundtrip

        def undecodable(*args: Any) -> Any:
            endpoint._roundtrip = roundtrip  # type: ignore[method-assign]
            raise RuntimeError("canary reply could not be decoded")

        endpoint._roundtrip = undecodable  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError):
            client.get("k")
        assert breaker.state is not CircuitState.CLOSED
