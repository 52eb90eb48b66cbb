"""A real out-of-memory status (0x82) from memcached, mapped and retried as RFC 0049 says.

memcached with ``-M`` (no eviction) and a tiny ``-m`` answers a store it cannot
place with NO_MEMORY. RFC 0049's response-code retry list does not name 0x82, so
the KV mapper completes the request with TemporaryFailureException at once: even
the best-effort strategy sends it exactly once.
"""

from __future__ import annotations

import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import BestEffortRetryStrategy, RetryOrchestrator, TemporaryFailureException
from sdkcore.examples.memcached import MemcachedClient, SyncMemcachedClient
from sdkcore.mapping import KvOpcode, KvStatus, kv_retry_reason

pytestmark = pytest.mark.anyio

VALUE = b"x" * 500_000  # with -m 2, a handful of these fill memcached


@pytest.fixture
def tiny(start_memcached: object) -> Memcached:
    server: Memcached = start_memcached("-M", "-m", "2")  # type: ignore[operator]
    return server


@pytest.fixture
def tiny_proxy(tiny: Memcached) -> object:
    fault = FaultProxy(tiny.port).start()
    yield fault
    fault.stop()


def test_no_memory_is_not_on_the_retry_list() -> None:
    assert kv_retry_reason(KvStatus.NO_MEMORY, KvOpcode.SET) is None


async def test_out_of_memory_fails_at_once_with_temporary_failure(tiny_proxy: FaultProxy) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    stored: list[str] = []

    async def fill(client: MemcachedClient) -> None:
        for i in range(100):  # bounded: memcached runs out long before
            await client.set(f"big-{i}", VALUE)
            stored.append(f"big-{i}")

    async with MemcachedClient(f"127.0.0.1:{tiny_proxy.port}", orchestrator=orchestrator) as client:
        with pytest.raises(TemporaryFailureException, match="0x82 NO_MEMORY on SET") as caught:
            await fill(client)
        assert stored
        _, _, requests = tiny_proxy.counts()
        assert requests[KvOpcode.SET] == len(stored) + 1  # the failing SET was sent once
        context = caught.value.context
        assert context is not None
        assert context.retry_attempts == 0
        assert "Out of memory" in str(caught.value.__cause__)
        assert client.breakers[0].counts[1] == 0  # an answer is not a breaker failure


def test_out_of_memory_on_the_sync_door(tiny: Memcached) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())

    def fill(client: SyncMemcachedClient) -> None:
        for i in range(100):
            client.set(f"big-{i}", VALUE)

    with SyncMemcachedClient(tiny.address, orchestrator=orchestrator) as client:
        with pytest.raises(TemporaryFailureException, match="NO_MEMORY"):
            fill(client)
        client.noop()  # still usable: the failure was an answer
