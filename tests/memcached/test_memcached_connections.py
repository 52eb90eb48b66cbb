"""When the memcached example clients close a connection, and what they refuse to read.

* A frame whose write was cut (a deadline while memcached does not read) closes
  its connection: later frames never become the rest of the cut value.
* A connection that stays silent through a deadline is replaced, canaries included.
* The sync client gives each socket operation only the time left.
* A reply that does not fit the request is a ProtocolError, not a struct.error or b"".
* An error leaves ``async with MemcachedClient`` as it was raised, on trio too.
* The sync client takes the breaker's probe only once it holds the connection.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import anyio
import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached
from scripted_server import ScriptedServer, elapsed_since, response

from sdkcore import (
    CircuitBreaker,
    CircuitState,
    CouchbaseException,
    DocumentNotFoundException,
    Request,
    RetryOrchestrator,
    TimeoutException,
)
from sdkcore.examples.memcached import (
    MemcachedClient,
    ProtocolError,
    SyncMemcachedClient,
    endpoint_down,
)
from sdkcore.examples.memcached import _protocol as proto
from sdkcore.mapping import KvOpcode, kv_request

pytestmark = pytest.mark.anyio

BIG = 8 * 1024 * 1024
LATER = [bytes([ord("a") + i]) * (1024 * 1024) for i in range(12)]
#: A safety net on a whole test, not a timing claim.
LIMIT = 60


@pytest.fixture
def roomy(start_memcached: Callable[..., Memcached]) -> Memcached:
    """memcached that stores 8 MiB values (-I) and all of this file's (-m)."""
    return start_memcached("-I", "16m", "-m", "256")


@pytest.fixture
def stopped(roomy: Memcached) -> Iterator[Callable[[bool], None]]:
    """``stop(True)``: SIGSTOP memcached (it reads nothing); ``stop(False)``: SIGCONT."""
    assert roomy.process is not None
    pid = roomy.process.pid

    def stop(yes: bool) -> None:
        os.kill(pid, signal.SIGSTOP if yes else signal.SIGCONT)

    try:
        yield stop
    finally:
        stop(False)


def never_trips(name: str) -> CircuitBreaker:
    return CircuitBreaker(name=name, volume_threshold=10**9)


# -- a write cut mid-frame ------------------------------------------------------------------


async def test_a_write_cut_mid_frame_closes_its_connection(
    roomy: Memcached, stopped: Callable[[bool], None]
) -> None:
    old, new = b"o" * BIG, b"n" * BIG
    with anyio.fail_after(LIMIT):
        async with MemcachedClient(roomy.address, timeout=10.0) as setup:
            await setup.set("big", old)
        async with MemcachedClient(roomy.address, timeout=1.0, breaker=never_trips) as client:
            await client.noop()  # the connection is open
            stopped(True)
            with pytest.raises(TimeoutException):
                await client.set("big", new)  # memcached reads nothing: cut mid-frame
            stopped(False)
            failed: list[CouchbaseException] = []
            for i, value in enumerate(LATER):
                try:
                    await client.set(f"later-{i}", value)
                except CouchbaseException as exc:
                    failed.append(exc)
        async with MemcachedClient(roomy.address, timeout=10.0) as check:
            try:
                got: bytes | None = await check.get("big")
            except DocumentNotFoundException:
                got = None
    # the cut SET was not applied, or (asyncio had buffered all of it) applied whole: never
    # completed by the later frames
    assert got is None or got in (old, new), "the cut value holds later frames"
    assert failed == []  # every later SET went out on a sound connection


def test_a_write_cut_mid_frame_closes_the_sync_socket(
    roomy: Memcached, stopped: Callable[[bool], None]
) -> None:
    old, new = b"o" * BIG, b"n" * BIG
    with SyncMemcachedClient(roomy.address, timeout=10.0) as setup:
        setup.set("big", old)
    with SyncMemcachedClient(roomy.address, timeout=1.0, breaker=never_trips) as client:
        client.noop()
        stopped(True)
        with pytest.raises(TimeoutException):
            client.set("big", new)
        stopped(False)
        failed: list[CouchbaseException] = []
        for i, value in enumerate(LATER):
            try:
                client.set(f"later-{i}", value)
            except CouchbaseException as exc:
                failed.append(exc)
    with SyncMemcachedClient(roomy.address, timeout=10.0) as check:
        try:
            got: bytes | None = check.get("big")
        except DocumentNotFoundException:
            got = None
    assert got is None or got in (old, new), "the cut value holds later frames"
    assert failed == []


# -- a black-holed connection is replaced --------------------------------------------------


async def test_a_connection_silent_through_a_timeout_is_replaced(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    with anyio.fail_after(LIMIT):
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}", timeout=0.3, breaker=never_trips
        ) as client:
            await client.set("k", b"v")
            proxy.black_hole_open()  # this connection answers nothing from now on
            with pytest.raises(TimeoutException):
                await client.get("k")
            assert await client.get("k") == b"v"  # on a new connection
    connections, _, _ = proxy.counts()
    assert connections == 2


async def test_requests_failed_by_a_silent_connections_close_are_told_whose_deadline(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """A SET in flight on a connection closed because a GET's deadline passed in its
    silence read "no byte from ... before the deadline", 0.2 s before its own deadline
    came: its own, it seemed. The close names whose deadline it was."""
    failures: dict[str, BaseException] = {}
    with anyio.fail_after(LIMIT):
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}", timeout=0.3, breaker=never_trips
        ) as client:
            await client.set("k", b"v")
            proxy.black_hole_open()

            async def get() -> None:
                try:
                    await client.get("k")
                except TimeoutException as exc:
                    failures["get"] = exc

            async def set_later() -> None:
                await anyio.sleep(0.2)  # in flight when the GET's deadline passes
                try:
                    await client.set("k2", b"v2")
                except CouchbaseException as exc:
                    failures["set"] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(get)
                tg.start_soon(set_later)
    get_context = failures["get"].context  # type: ignore[attr-defined]
    text = str(failures["set"])
    assert f"until request {get_context.request_id}'s deadline" in text, text
    assert "closed: no byte from it for" in text, text


async def test_a_frame_sent_with_little_time_left_does_not_close_a_slow_connection(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    # Every frame held 150 ms: slow, not dead. A GET made inside an outer request that
    # spent 0.45 of its 0.5 s first writes its frame with 50 ms left, and nothing comes
    # back before then. Taken for a black hole, the connection was closed, and a SET in
    # flight on it failed (SOCKET_CLOSED_WHILE_IN_FLIGHT: not retried, not idempotent):
    # the memcached-outage demo's one request failed after the breaker closed this way.
    # Fifty milliseconds of silence say nothing when half the GET's timeout is a second.
    proxy.request_latency = lambda frame: 0.15
    outcomes: dict[str, object] = {}
    with anyio.fail_after(LIMIT):
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}", timeout=2.0, breaker=never_trips
        ) as client:
            await client.set("k", b"v")  # the connection is open

            async def late_get(request: Request) -> bytes:
                await anyio.sleep(0.45)
                return await client.get("k")  # inherits the outer request's last 50 ms

            async def get() -> None:
                try:
                    await RetryOrchestrator().execute(Request(timeout=0.5), late_get)
                except CouchbaseException as exc:
                    outcomes["get"] = exc

            async def set_meanwhile() -> None:
                await anyio.sleep(0.44)  # in flight when the GET's deadline passes
                outcomes["set"] = await client.set("k2", b"v2")

            async with anyio.create_task_group() as tg:
                tg.start_soon(get)
                tg.start_soon(set_meanwhile)
    assert isinstance(outcomes["get"], TimeoutException)
    assert isinstance(outcomes["set"], int)  # the SET's CAS: it was answered
    connections, _, _ = proxy.counts()
    assert connections == 1  # the slow connection was kept


async def test_the_canary_does_not_go_down_a_black_holed_connection(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    def breaker(name: str) -> CircuitBreaker:
        return CircuitBreaker(name=name, volume_threshold=1, sleep_window=0.1, canary_timeout=0.1)

    with anyio.fail_after(LIMIT):
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}", timeout=1.0, breaker=breaker
        ) as client:
            await client.set("k", b"v")
            proxy.black_hole_open()
            client.breakers[0].record_failure(TimeoutError("tripped by the test"))
            await anyio.sleep(0.1)  # the sleep window
            # The probe's NOOP goes down the dead connection and gets nothing in 0.1 s:
            # OPEN again, and that connection is closed; the next probe connects anew,
            # is answered, and the GET goes out (before, every probe used the dead one).
            assert await client.get("k") == b"v"
            assert client.breakers[0].state is CircuitState.CLOSED
    connections, _, requests = proxy.counts()
    assert connections == 2
    assert requests[KvOpcode.NOOP] == 2


async def test_a_canary_with_less_time_than_its_timeout_still_replaces_a_black_holed_connection(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """canary_timeout (0.4 s) above twice the request's timeout (0.15 s), as with the
    defaults (5 s against 2.5 s): each probe's canary has only the request's time left, so a
    silence threshold of half canary_timeout (0.2 s) was never reached, the black-holed
    connection was never closed, and every later probe went down it while the server
    answered. Half the canary's own bound closes it."""

    def breaker(name: str) -> CircuitBreaker:
        return CircuitBreaker(
            name=name,
            volume_threshold=1,
            sleep_window=0.05,
            canary_timeout=0.4,
            is_failure=endpoint_down,
        )

    with anyio.fail_after(LIMIT):
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}", timeout=0.15, breaker=breaker
        ) as client:
            await client.set("k", b"v")
            proxy.black_hole_open()  # the connection stays dead (a stuck NAT entry)
            client.breakers[0].record_failure(TimeoutError("tripped by the test"))
            answered = 0
            until = time.monotonic() + 2.0
            while time.monotonic() < until and not answered:
                await anyio.sleep(0.06)  # past the sleep window
                with contextlib.suppress(CouchbaseException):
                    answered += await client.get("k") == b"v"
            assert answered  # a probe replaced the dead connection and the GET went out
    connections, _, _ = proxy.counts()
    assert connections >= 2


# -- the sync client's socket timeouts -------------------------------------------------------


def test_each_sync_recv_gets_only_the_time_left() -> None:
    def answer(opcode: int, opaque: int) -> bytes:
        return response(opcode, opaque, extras=b"\0\0\0\0", value=b"v" * 12)  # 40 bytes

    with (
        ScriptedServer(answer, trickle=0.1) as server,  # a byte every 0.1 s: 4 s in all
        SyncMemcachedClient(server.address, timeout=0.5, breaker=never_trips) as client,
    ):
        started = time.monotonic()
        with pytest.raises(TimeoutException):
            client.get("k")
        took = elapsed_since(started)
    assert took < 1.5, took  # about 0.5 s; before, 4 s and the GET succeeded


def test_a_sync_client_without_timeout_keeps_within_the_enclosing_request(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    proxy.delay = 2.0  # every reply held 2 s
    orchestrator = RetryOrchestrator()
    with SyncMemcachedClient(
        f"127.0.0.1:{proxy.port}",
        timeout=None,  # type: ignore[arg-type]
        breaker=never_trips,
    ) as client:

        def send(request: Request) -> bytes:
            return client.get("k")

        started = time.monotonic()
        with pytest.raises(TimeoutException):
            orchestrator.execute_sync(Request(timeout=0.5, idempotent=True), send)
        took = elapsed_since(started)
    assert took < 1.5, took  # about 0.5 s; before, it waited for the reply


# -- replies that do not fit -----------------------------------------------------------------


def short_counter(opcode: int, opaque: int) -> bytes:
    return response(opcode, opaque, value=b"\0\1")  # a counter is 8 bytes


def set_reply(opcode: int, opaque: int) -> bytes:
    return response(KvOpcode.SET, opaque)  # whatever was asked


INCR_ERROR = r"expected an 8-byte counter in the value of the INCREMENT .* got 2 bytes"
GET_ERROR = r"expected a response to GET \(opcode 0x00\) .* got a response to SET \(opcode 0x01\)"


@pytest.mark.parametrize(
    ("answer", "call", "error"),
    [
        (short_counter, lambda c: c.incr("n"), INCR_ERROR),
        (set_reply, lambda c: c.get("k"), GET_ERROR),
    ],
    ids=["incr-2-bytes", "get-answered-by-set"],
)
async def test_a_reply_that_does_not_fit_is_a_protocol_error(
    answer: Callable[[int, int], bytes], call: Callable[..., object], error: str
) -> None:
    with ScriptedServer(answer) as server:
        with anyio.fail_after(LIMIT):
            async with MemcachedClient(server.address, timeout=2.0) as client:
                with pytest.raises(ProtocolError, match=error):
                    await call(client)  # type: ignore[misc]
                with pytest.raises(ProtocolError):
                    await call(client)  # type: ignore[misc]
    assert server.connections == 2  # a connection that broke the protocol is not reused


@pytest.mark.parametrize(
    ("answer", "call", "error"),
    [
        (short_counter, lambda c: c.incr("n"), INCR_ERROR),
        (set_reply, lambda c: c.get("k"), GET_ERROR),
    ],
    ids=["incr-2-bytes", "get-answered-by-set"],
)
def test_a_reply_that_does_not_fit_is_a_protocol_error_on_the_sync_client(
    answer: Callable[[int, int], bytes], call: Callable[..., object], error: str
) -> None:
    with ScriptedServer(answer) as server, SyncMemcachedClient(server.address, timeout=2.0) as c:
        with pytest.raises(ProtocolError, match=error):
            call(c)
        with pytest.raises(ProtocolError):
            call(c)
    assert server.connections == 2


# -- the client's task group -----------------------------------------------------------------


async def test_an_error_leaves_the_async_with_as_it_was_raised(memcached: Memcached) -> None:
    boom = KeyError("boom")

    async def fails() -> None:
        async with MemcachedClient(memcached.address) as client:
            await client.set("k", b"v")  # a reader task is running
            raise boom

    with pytest.raises(KeyError) as caught:
        await fails()
    assert caught.value is boom  # not an ExceptionGroup around it (trio's nursery)
    with anyio.move_on_after(0.05) as scope:  # an outer cancellation passes through too
        async with MemcachedClient(memcached.address) as client:
            await client.noop()
            await anyio.sleep(30)
    assert scope.cancelled_caught


# -- the sync client's probe -------------------------------------------------------------------


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_sync_probe_is_taken_only_with_the_connection(memcached: Memcached) -> None:
    clock = Clock()

    def breaker(name: str) -> CircuitBreaker:
        return CircuitBreaker(name=name, volume_threshold=1, sleep_window=1.0, clock=clock)

    with SyncMemcachedClient(memcached.address, timeout=10.0, breaker=breaker) as client:
        client.set("k", b"v")
        endpoint = client._endpoints[0]
        the_breaker = client.breakers[0]
        the_breaker.record_failure(TimeoutError("tripped by the test"))
        clock.now += 1.0  # the sleep window is over: the next admit is the probe
        got: list[bytes] = []
        endpoint._lock.acquire()  # another request holds the connection
        try:
            thread = threading.Thread(target=lambda: got.append(client.get("k")))
            thread.start()
            time.sleep(0.2)  # the GET waits for the connection ...
            assert the_breaker.state is CircuitState.OPEN  # ... without holding the probe
        finally:
            endpoint._lock.release()
        thread.join(timeout=LIMIT)
        assert got == [b"v"]  # then it probes (a NOOP), closes the breaker, and reads
        assert the_breaker.state is CircuitState.CLOSED  # type: ignore[comparison-overlap]  # stale narrowing


@pytest.mark.parametrize("coin", [0.0, 0.99])
def test_a_cut_wait_whose_answer_arrived_in_a_stall_keeps_its_connection_on_trio(
    memcached: Memcached, proxy: FaultProxy, coin: float
) -> None:
    """A GET (40 ms) is answered after 15 ms on the connection a SET (held 150 ms) is in
    flight on, while the loop stalls 60 ms: its answer is in the socket when its deadline is
    seen. trio runs the GET's task and the reader's in one batch, in either order (its
    scheduler's coin, pinned to each side here); with the GET first the client took the
    connection for black-holed and closed it, failing the SET in flight."""
    import trio._core._run as trio_run

    scheduler = getattr(trio_run, "_r", None)
    if scheduler is None:  # pragma: no cover - trio's private scheduler moved
        pytest.skip("trio's scheduler coin is not where this test pins it")
    proxy.request_latency = lambda frame: {KvOpcode.GET: 0.015, KvOpcode.SET: 0.15}.get(  # type: ignore[call-overload]
        frame[1], 0.0
    )

    async def scenario() -> tuple[object, object, object]:
        orchestrator = RetryOrchestrator()
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}", orchestrator=orchestrator, timeout=2.0, breaker=never_trips
        ) as client:
            await client.set("k", b"v")  # connected
            endpoint = client._endpoints[0]
            connection = endpoint._connection
            assert connection is not None
            results: dict[str, object] = {}

            async def set_in_flight() -> None:
                try:
                    results["set"] = await client.set("s", b"x")
                except CouchbaseException as exc:
                    results["set"] = exc

            async def get() -> None:
                request = kv_request(KvOpcode.GET, timeout=0.04)

                async def send(request: Request) -> object:
                    return await endpoint.send(
                        request, KvOpcode.GET, lambda opaque: proto.get_frame(opaque, "k")
                    )

                try:
                    results["get"] = await orchestrator.execute(request, send)
                except CouchbaseException as exc:
                    results["get"] = exc

            async def stall() -> None:
                await anyio.sleep(0.003)  # both frames written; the GET's answer comes at 15 ms
                time.sleep(0.06)  # noqa: ASYNC251 - the loop stalls past the deadline

            async with anyio.create_task_group() as tg:
                tg.start_soon(set_in_flight)
                await anyio.sleep(0.002)  # the SET is written first
                tg.start_soon(get)
                tg.start_soon(stall)
            return connection.lost, results.get("set"), results.get("get")

    original = scheduler.random
    scheduler.random = lambda: coin
    try:
        lost, stored, _ = anyio.run(scenario, backend="trio")
    finally:
        scheduler.random = original
    assert lost is None  # the connection was answering: it stays
    assert not isinstance(stored, CouchbaseException)
