"""Review fixes of the memcached example clients, each proven against a real memcached.

* The async client: a request whose caller was already cancelled (a lost hedge race, a
  ``move_on_after``), or whose deadline had already passed, when it got the write lock
  wrote nothing; it used to close the shared connection anyway, and every other
  request in flight on it failed (a SET as "may have been applied").
* The async client on asyncio: an attempt cancelled (``Task.cancel()``) while its frame
  was being handed to the transport was never remembered as cut: its late answer was
  not reported to the orphan reporter.
* The sync client: a pooled socket the server had closed (memcached restarted) took
  the next request, whose answer then read as the connection closing in flight: a SET
  never sent failed as "may have been applied".
* The sync client: a stream that is not the protocol let ``ProtocolError`` escape,
  unseen by the breaker; a NOOP probe answered that way left the breaker HALF_OPEN,
  refusing every request until ``canary_timeout``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import pytest
from fault_proxy import FaultProxy
from fuzz_kit import CountingBudget
from lingering_stream import LingeringSend
from memcached_server import Memcached
from scripted_server import ScriptedServer, response

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    CouchbaseException,
    FailFastRetryStrategy,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore._orphans import OrphanReporter
from sdkcore.examples.memcached import MemcachedClient, SyncMemcachedClient, endpoint_down
from sdkcore.examples.memcached import _protocol as proto
from sdkcore.examples.memcached._client import _Connection
from sdkcore.mapping import KvOpcode

HOLD = 1.0  # the proxy holds a SET frame this long: it is in flight while another is cut
SAFETY = 20  # a safety net on every test, not a timing claim


async def wait_for(predicate: Callable[[], bool]) -> None:
    with anyio.fail_after(SAFETY):
        while not predicate():  # noqa: ASYNC110 - polls a counter kept on another thread
            await anyio.sleep(0.005)


def requests(proxy: FaultProxy, opcode: int) -> int:
    return proxy.counts()[2].get(opcode, 0)


# -- 1. async: a request cut before its write leaves the connection to the others --------
@pytest.mark.anyio
@pytest.mark.parametrize("cut", ["cancelled", "deadline passed"])
async def test_a_request_cut_before_its_write_leaves_the_connection_to_the_others(
    memcached: Memcached, proxy: FaultProxy, anyio_backend: str, cut: str
) -> None:
    """A SET is in flight; a GET gets the write lock just after its caller gave up.

    ``cancelled``: its cancel scope is cancelled as the lock is handed to it (a lost
    hedge race). ``deadline passed``: its scope's deadline passes while it waits for
    the lock (``fail_after``/``move_on_after``); on asyncio it runs before the scope's
    timer fires, so it sees a bound already past, not a cancellation: an attempt not
    sent, retried, and cancelled in the backoff. Either way the GET wrote nothing: the
    connection must stay, and the SET must be answered.
    """
    proxy.request_latency = lambda frame: HOLD if frame[1] == KvOpcode.SET else 0.0
    outcomes: dict[str, Any] = {}
    with anyio.fail_after(SAFETY):
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}", timeout=SAFETY / 2, retry_strategy=BestEffortRetryStrategy()
        ) as client:
            await client.noop()  # connected
            endpoint = client._endpoints[0]
            connection = endpoint._connection
            assert connection is not None

            async def set_in_flight() -> None:
                outcomes["set"] = await client.set("k", b"v")

            scope = anyio.CancelScope()

            async def cut_get() -> None:
                with scope:
                    await client.get("other")

            async with anyio.create_task_group() as tg:
                tg.start_soon(set_in_flight)
                await wait_for(lambda: requests(proxy, KvOpcode.SET) == 1)  # the SET is out
                await connection.write_lock.acquire()  # another request's write under way
                tg.start_soon(cut_get)
                await anyio.wait_all_tasks_blocked()  # the GET waits for the write lock
                if cut == "cancelled":
                    connection.write_lock.release()  # the lock goes to the GET ...
                    scope.cancel()  # ... whose caller gives up now
                else:
                    scope.deadline = anyio.current_time() + 0.001
                    # the deadline passes with no checkpoint, before the GET runs again
                    time.sleep(0.02)  # noqa: ASYNC251 - blocks the loop on purpose
                    connection.write_lock.release()
            assert scope.cancelled_caught
            assert connection.lost is None
            assert isinstance(outcomes["set"], int)  # answered: its CAS
            assert endpoint._connection is connection
            assert requests(proxy, KvOpcode.GET) == 0  # the cut GET was never written
            assert await client.get("k") == b"v"  # the same connection goes on


@pytest.mark.anyio
async def test_a_set_waiting_for_the_write_lock_when_the_connection_drops_is_not_sent(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """A memcached SDK maintainer's review: requests waiting for the write lock when the
    connection was lost wrote nothing, but failed as lost in flight, so a SET was refused
    as "may have been applied" and its retry never tried; each also counted as a failure
    for the breaker. Now it is not sent: the SET is retried on a new connection, once."""
    budget = CountingBudget(RetryBudget(), [], lambda: None)
    with anyio.fail_after(SAFETY):
        async with MemcachedClient(
            f"127.0.0.1:{proxy.port}",
            timeout=SAFETY / 2,
            orchestrator=RetryOrchestrator(BestEffortRetryStrategy(), retry_budget=budget),
        ) as client:
            await client.noop()  # connected
            endpoint = client._endpoints[0]
            connection = endpoint._connection
            assert connection is not None
            outcomes: dict[str, Any] = {}

            async def put() -> None:
                outcomes["set"] = await client.set("k", b"v")

            async with anyio.create_task_group() as tg:
                await connection.write_lock.acquire()  # another request's write under way
                tg.start_soon(put)
                await anyio.wait_all_tasks_blocked()  # the SET waits for the write lock
                await connection.drop("the test drops the connection")
                connection.write_lock.release()
            assert isinstance(outcomes["set"], int)  # answered: its CAS
            assert requests(proxy, KvOpcode.SET) == 1  # written once, on the new connection
            assert endpoint._connection is not connection
            assert endpoint.breaker.counts[1] == 0  # no failure: nothing was asked of it
            assert budget.granted + budget.refused == 0  # a retry after nothing sent is free
            assert await client.get("k") == b"v"


@pytest.mark.anyio
async def test_a_set_whose_deadline_passes_waiting_for_the_write_lock_is_unambiguous(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """It was never written, but timed out as "attempt 1 in flight at the deadline; it
    may have been applied (ambiguous)": the client now says so (``dispatch_unsent``)."""
    with anyio.fail_after(SAFETY):
        async with MemcachedClient(f"127.0.0.1:{proxy.port}", timeout=0.3) as client:
            await client.noop()  # connected
            connection = client._endpoints[0]._connection
            assert connection is not None
            outcome: list[BaseException] = []

            async def put() -> None:
                try:
                    await client.set("k", b"v")
                except UnambiguousTimeoutException as exc:
                    outcome.append(exc)

            await connection.write_lock.acquire()  # another request's long write under way
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(put)  # waits for the lock until its deadline
            finally:
                connection.write_lock.release()
            [error] = outcome
            assert "it was not applied on the server (unambiguous)" in str(error)
            assert requests(proxy, KvOpcode.SET) == 0
            assert connection.lost is None  # the connection stays for the others


# -- 1b. async on asyncio: a cut during the write is remembered for the orphan reporter ---
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_attempt_cancelled_while_its_frame_drains_is_reported_as_an_orphan(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    # sdkcore's asyncio runtime cuts an attempt with Task.cancel(): no scope to shield from
    reporter = OrphanReporter(clock=lambda: 0.0)  # frozen: nothing is emitted by itself
    proxy.delay = 0.2  # the answer comes after the cut
    name = f"127.0.0.1:{proxy.port}"
    with anyio.fail_after(SAFETY):
        stream = LingeringSend(await anyio.connect_tcp("127.0.0.1", proxy.port), linger=SAFETY)
        connection = _Connection(stream, name, reporter)
        async with anyio.create_task_group() as tg:
            tg.start_soon(connection.read_loop)
            attempt = asyncio.ensure_future(
                connection.roundtrip(proto.noop_frame(0x77), 0x77, lambda: False)
            )
            await stream.written.wait()
            attempt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await attempt
            assert connection.lost is None
            await wait_for(lambda: reporter.report() is not None)  # the reader records it
            tg.cancel_scope.cancel()
    report = reporter.report()
    assert report is not None
    [entry] = report["kv"]["top_requests"]
    assert entry["operation_name"] == "noop"
    assert entry["operation_id"] == "0x77"
    assert entry["last_remote_socket"] == name


# -- 2. sync: a pooled socket the server closed is replaced before anything is sent -------
def test_sync_set_after_memcached_restarted_is_sent_on_a_new_connection(
    memcached: Memcached,
) -> None:
    with SyncMemcachedClient(memcached.address, timeout=SAFETY / 2) as client:
        client.set("k", b"1")
        memcached.kill()  # its socket to the client is closed (FIN)
        memcached.start()  # same port
        client.set("k", b"2")  # was: "not retried ... may have been applied"
        assert client.get("k") == b"2"
        assert client.breakers[0].counts[1] == 0  # no failure


def test_sync_request_after_the_connection_was_reset_is_sent_on_a_new_connection(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    with SyncMemcachedClient(f"127.0.0.1:{proxy.port}", timeout=SAFETY / 2) as client:
        client.set("k", b"1")
        proxy.cut_all()  # the connection is reset (RST), as a crashed server's would be
        proxy.reset_counts()
        client.set("k", b"2")
        assert proxy.counts() == (1, 0, {KvOpcode.SET: 1})  # one new connection, one SET
        assert client.get("k") == b"2"
        assert client.breakers[0].counts[1] == 0


# -- 3. sync: a stream that is not the protocol is the endpoint failing ------------------
def bad_magic_when(bad: dict[str, bool]) -> Callable[[int, int], bytes]:
    def answer(opcode: int, opaque: int) -> bytes:
        out = response(opcode, opaque)
        return b"\x99" + out[1:] if bad["now"] else out

    return answer


def causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(chain) < 10:
        chain.append(current)
        current = current.__cause__
    return chain


def reason_of(error: CouchbaseException) -> RetryReason | None:
    assert error.context is not None
    return error.context.reason


def test_sync_broken_stream_is_a_connection_failure_the_breaker_counts() -> None:
    with (
        ScriptedServer(bad_magic_when({"now": True})) as server,
        SyncMemcachedClient(
            server.address, timeout=SAFETY / 2, retry_strategy=FailFastRetryStrategy()
        ) as client,
    ):
        with pytest.raises(CouchbaseException) as raised:
            client.get("k")  # was: a raw ProtocolError
        chain = causes(raised.value)
        assert reason_of(raised.value) is RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT
        assert any(
            isinstance(e, ConnectionResetError) and "broke the protocol" in str(e) for e in chain
        )
        assert isinstance(chain[-1], proto.ProtocolError)
        assert client.breakers[0].counts == (1, 1)
        with pytest.raises(CouchbaseException):
            client.get("k")
        assert server.connections == 2  # the broken socket was not reused


def state_of(breaker: CircuitBreaker) -> CircuitState:
    return breaker.state


def test_sync_probe_answered_out_of_protocol_opens_the_breaker_again() -> None:
    now = [0.0]
    breaker = CircuitBreaker(
        name="probe",
        is_failure=endpoint_down,
        volume_threshold=1,
        sleep_window=1.0,
        canary_timeout=60.0,
        clock=lambda: now[0],
    )
    bad = {"now": False}
    with (
        ScriptedServer(bad_magic_when(bad)) as server,
        SyncMemcachedClient(
            server.address,
            timeout=SAFETY / 2,
            retry_strategy=FailFastRetryStrategy(),
            breaker=lambda name: breaker,
        ) as client,
    ):
        breaker.record_failure(ConnectionResetError("tripped by the test"))
        assert breaker.state is CircuitState.OPEN
        now[0] += 2.0  # past the sleep window: the next dispatch is the probe
        bad["now"] = True
        with pytest.raises(CouchbaseException) as raised:
            client.noop()  # was: a raw ProtocolError, and the probe never reported
        assert reason_of(raised.value) is RetryReason.CIRCUIT_BREAKER_OPEN  # the canary failed
        assert breaker.state is CircuitState.OPEN  # was: HALF_OPEN until canary_timeout
        bad["now"] = False
        now[0] += 2.0
        client.noop()  # the next probe closes it
        assert state_of(breaker) is CircuitState.CLOSED


# -- 5. sync: an interrupt as the connection's lock is taken; a deadline before the write -----
class _InterruptAfterAcquire:
    """The endpoint's lock, with an interrupt delivered as ``acquire()`` returns (where
    CPython runs a pending signal handler after the C call), before the dispatch's try."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.armed = True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got: bool = self.real.acquire(blocking, timeout)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return got

    def release(self) -> None:
        self.real.release()


def test_sync_interrupt_as_the_connection_lock_is_taken_leaves_it_free(
    memcached: Memcached,
) -> None:
    """The lock was taken outside the try that releases it: after one Ctrl-C every later
    request on the endpoint waited for it until its deadline (SOCKET_NOT_AVAILABLE), and
    ``close()`` blocked for ever."""
    client = SyncMemcachedClient(f"127.0.0.1:{memcached.port}", timeout=0.3)
    client.set("k", b"v")
    endpoint = client._endpoints[0]
    real = endpoint._lock
    endpoint._lock = _InterruptAfterAcquire(real)  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        client.get("k")
    endpoint._lock = real
    assert client.get("k") == b"v"
    closer = threading.Thread(target=client.close, daemon=True)
    closer.start()
    closer.join(SAFETY)
    assert not closer.is_alive()


def test_sync_deadline_passing_before_the_write_keeps_the_socket_and_is_unambiguous(
    memcached: Memcached, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline passes between the dispatch's last look and the write (a thread
    descheduled there): nothing was written. The socket was dropped, the breaker counted
    a failure and the SET, never sent, ended "may have been applied"."""
    from sdkcore.examples.memcached import _sync_client

    client = SyncMemcachedClient(f"127.0.0.1:{memcached.port}", timeout=0.2)
    client.noop()  # a pooled, healthy socket
    endpoint = client._endpoints[0]
    pooled = endpoint._sock
    real = _sync_client._closed_by_peer

    def descheduled(sock: Any) -> bool:  # the thread loses the CPU past the deadline here
        time.sleep(0.25)
        return real(sock)

    monkeypatch.setattr(_sync_client, "_closed_by_peer", descheduled)
    with pytest.raises(UnambiguousTimeoutException):
        client.set("never-written", b"v")
    monkeypatch.undo()
    assert endpoint._sock is pooled  # kept: nothing went wrong with it
    assert endpoint.breaker.counts[1] == 0  # nothing was sent: no failure of the endpoint
    client.close()
    with (
        SyncMemcachedClient(f"127.0.0.1:{memcached.port}") as other,
        pytest.raises(CouchbaseException),
    ):
        other.get("never-written")


@pytest.mark.anyio
async def test_async_connection_without_a_reader_is_closed(memcached: Memcached) -> None:
    """A client used without ``async with`` refuses each request (RuntimeError): the
    socket it had connected stayed open for as long as the error lived."""
    client = MemcachedClient(f"127.0.0.1:{memcached.port}", orchestrator=RetryOrchestrator())
    before = len(os.listdir("/proc/self/fd"))
    errors = []
    for _ in range(10):
        with pytest.raises(RuntimeError, match="async with") as info:
            await client.get("k")
        errors.append(info.value)  # kept, as an application logging its failures would
    assert len(os.listdir("/proc/self/fd")) == before


def test_sync_client_takes_every_timeout_a_request_takes(memcached: Memcached) -> None:
    """``timeout=1e10`` s (a Request takes it) overflowed the OS's waits: every operation
    failed with OverflowError ("timestamp out of range for platform time_t")."""
    with SyncMemcachedClient(f"127.0.0.1:{memcached.port}", timeout=1e10) as client:
        client.set("k", b"v")
        assert client.get("k") == b"v"
