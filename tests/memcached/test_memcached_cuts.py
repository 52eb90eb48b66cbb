"""INCR under connection cuts: each non-idempotent increment applied at most once.

The fault proxy forwards every request to memcached and cuts the connection in
the middle of every third INCR and GET reply. A cut INCR was applied by memcached
but its answer was lost: SOCKET_CLOSED_WHILE_IN_FLIGHT does not allow retrying a
non-idempotent request, so it is never sent again. A cut GET is idempotent and is
retried until it succeeds.
"""

from __future__ import annotations

import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    BestEffortRetryStrategy,
    CouchbaseException,
    RequestCanceledException,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore.examples.memcached import MemcachedClient, SyncMemcachedClient
from sdkcore.mapping import KvOpcode

pytestmark = pytest.mark.anyio

CALLS = 30


def check(
    proxy: FaultProxy, memcached_value: int, ok: int, failed: list[CouchbaseException]
) -> None:
    _, _, requests = proxy.counts()
    assert ok + len(failed) == CALLS
    assert failed, "the proxy cut some INCR replies"
    assert requests[KvOpcode.INCREMENT] == CALLS  # never re-sent
    assert memcached_value == CALLS  # each applied exactly once (at most once, and sent once)
    for exc in failed:
        assert exc.context is not None
        assert isinstance(exc, RequestCanceledException)  # not retried: maybe applied
        assert exc.context.reason is RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT
        assert exc.context.retry_attempts == 0
    assert requests[KvOpcode.GET] > CALLS  # cut GETs were sent again


async def test_incr_applied_at_most_once_while_gets_succeed(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    async with MemcachedClient(memcached.address) as direct:
        await direct.set("counter", b"0")
        await direct.set("doc", b"payload")
    proxy.cut_opcodes = frozenset({KvOpcode.INCREMENT, KvOpcode.GET})
    proxy.cut_every = 3
    ok = 0
    failed: list[CouchbaseException] = []
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}", orchestrator=orchestrator, timeout=5.0
    ) as client:
        for _ in range(CALLS):
            try:
                await client.incr("counter")
                ok += 1
            except CouchbaseException as exc:
                failed.append(exc)
            assert await client.get("doc") == b"payload"  # every GET succeeds
    proxy.cut_opcodes = frozenset()
    async with MemcachedClient(memcached.address) as direct:
        value = await direct.incr("counter", 0)
    check(proxy, value, ok, failed)


def test_incr_under_cuts_on_the_sync_door(memcached: Memcached, proxy: FaultProxy) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    with SyncMemcachedClient(memcached.address) as direct:
        direct.set("counter", b"0")
        direct.set("doc", b"payload")
    proxy.cut_opcodes = frozenset({KvOpcode.INCREMENT, KvOpcode.GET})
    proxy.cut_every = 3
    ok = 0
    failed: list[CouchbaseException] = []
    with SyncMemcachedClient(
        f"127.0.0.1:{proxy.port}", orchestrator=orchestrator, timeout=5.0
    ) as client:
        for _ in range(CALLS):
            try:
                client.incr("counter")
                ok += 1
            except CouchbaseException as exc:
                failed.append(exc)
            assert client.get("doc") == b"payload"
    with SyncMemcachedClient(memcached.address) as direct:
        value = direct.incr("counter", 0)
    check(proxy, value, ok, failed)


def test_every_incr_cut_on_a_fresh_connection_is_never_sent_again(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    # each INCR after a cut goes out on a new connection: a reply lost there is still in flight
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    proxy.cut_opcodes = frozenset({KvOpcode.INCREMENT})
    proxy.cut_every = 1
    calls = 10
    with SyncMemcachedClient(
        f"127.0.0.1:{proxy.port}", orchestrator=orchestrator, timeout=5.0
    ) as client:
        for _ in range(calls):
            with pytest.raises(RequestCanceledException):
                client.incr("fresh-counter")
    with SyncMemcachedClient(memcached.address) as direct:
        assert direct.incr("fresh-counter", 0) == 9  # created at 0 by the first, then 9 more
    _, _, requests = proxy.counts()
    assert requests[KvOpcode.INCREMENT] == calls


async def test_every_incr_cut_async(memcached: Memcached, proxy: FaultProxy) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    proxy.cut_opcodes = frozenset({KvOpcode.INCREMENT})
    proxy.cut_every = 1
    calls = 10
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}", orchestrator=orchestrator, timeout=5.0
    ) as client:
        for _ in range(calls):
            with pytest.raises(RequestCanceledException):
                await client.incr("fresh-counter")
    async with MemcachedClient(memcached.address) as direct:
        assert await direct.incr("fresh-counter", 0) == 9
    _, _, requests = proxy.counts()
    assert requests[KvOpcode.INCREMENT] == calls
