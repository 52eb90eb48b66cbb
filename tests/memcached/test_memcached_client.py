"""The memcached example clients against a real memcached: commands, mapping, pipelining."""

from __future__ import annotations

import threading

import anyio
import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    AttemptEffect,
    BestEffortRetryStrategy,
    DocumentExistsException,
    DocumentNotFoundException,
    RetryOrchestrator,
)
from sdkcore.examples.memcached import MemcachedClient, SyncMemcachedClient
from sdkcore.mapping import KvOpcode

pytestmark = pytest.mark.anyio


async def test_commands_round_trip(memcached: Memcached) -> None:
    with anyio.fail_after(20):
        async with MemcachedClient(memcached.address) as client:
            cas = await client.set("greeting", b"hello")
            assert cas > 0
            assert await client.get("greeting") == b"hello"
            assert await client.add("fresh", b"1") > 0
            assert await client.incr("counter") == 0  # created at initial
            assert await client.incr("counter", 5) == 5
            await client.delete("greeting")
            await client.noop()


async def test_statuses_go_through_the_kv_mapper(memcached: Memcached) -> None:
    with anyio.fail_after(20):
        async with MemcachedClient(memcached.address) as client:
            with pytest.raises(DocumentNotFoundException, match="KEY_NOT_FOUND on GET"):
                await client.get("missing")
            await client.set("taken", b"x")
            with pytest.raises(DocumentExistsException, match="on ADD") as exists:
                await client.add("taken", b"y")
            with pytest.raises(DocumentNotFoundException, match="on DELETE"):
                await client.delete("missing")
    # The server's "exists" proves the ADD changed nothing: its context says so, where it
    # said "maybe_applied" on a refused write.
    context = exists.value.context
    assert context is not None
    assert [a.effect for a in context.attempts] == [AttemptEffect.NOT_APPLIED]


async def test_pipelined_on_one_connection_matched_by_opaque(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    values: dict[str, bytes] = {}
    with anyio.fail_after(30):
        async with MemcachedClient(f"127.0.0.1:{proxy.port}") as client:
            for i in range(50):
                key = f"key-{i}"
                values[key] = f"value-{i}".encode() * (i + 1)
                await client.set(key, values[key])
            got: dict[str, bytes] = {}

            async def read(key: str) -> None:
                got[key] = await client.get(key)

            async with anyio.create_task_group() as tg:
                for _ in range(4):  # 200 reads in flight at once
                    for key in values:
                        tg.start_soon(read, key)
    assert got == values
    connections, refused, requests = proxy.counts()
    assert (connections, refused) == (1, 0)
    assert requests[KvOpcode.GET] == 200


async def test_many_endpoints_one_connection_each(start_memcached: object) -> None:
    servers = [start_memcached() for _ in range(3)]  # type: ignore[operator]
    with anyio.fail_after(30):
        async with MemcachedClient([s.address for s in servers]) as client:
            for i in range(30):
                await client.set(f"k{i}", str(i).encode())
            for i in range(30):
                assert await client.get(f"k{i}") == str(i).encode()
            assert len(client.breakers) == 3
            assert {b.name for b in client.breakers} == {s.address for s in servers}


def test_sync_client_from_threads(memcached: Memcached) -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    errors: list[BaseException] = []
    with SyncMemcachedClient(memcached.address, orchestrator=orchestrator) as client:
        client.set("shared", b"0")
        client.set("hits", b"0")  # memcached counts on a decimal text value
        with pytest.raises(DocumentNotFoundException):
            client.get("missing")
        with pytest.raises(DocumentExistsException):
            client.add("shared", b"1")

        def work(n: int) -> None:
            try:
                for i in range(50):
                    client.incr("hits")
                    client.set(f"t{n}-{i}", b"v")
                    assert client.get(f"t{n}-{i}") == b"v"
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        assert client.incr("hits", 0) == 400
        client.noop()
        client.delete("shared")
