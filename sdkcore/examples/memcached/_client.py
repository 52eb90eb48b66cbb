"""An async memcached client whose every dispatch goes through sdkcore (asyncio and trio).

One connection per endpoint, pipelined: requests are written as they come and
responses are matched to them by ``opaque``. Each operation is a
:class:`~sdkcore.Request` (idempotency by opcode, RFC 0049) run by
``RetryOrchestrator.execute``; each dispatch is guarded by the endpoint's
:class:`~sdkcore.CircuitBreaker`, with a NOOP as the probe. See rfc/0007.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from sdkcore import (
    AdaptiveThrottle,
    CircuitBreaker,
    OrphanReporter,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
    dispatch_unsent,
)
from sdkcore.mapping import KvOpcode, kv_request

from . import _protocol as proto
from ._endpoint import (
    Address,
    BreakerFactory,
    EndpointGuards,
    Limiter,
    canary_bound,
    canary_failed,
    endpoint_guards,
    endpoints_of,
    make_breaker,
    pick,
    raise_for_status,
    refuse_if_open,
)

__all__ = ["MemcachedClient"]

#: The door's deadline scope fires on the event loop's clock, armed from the time left
#: on the request's clock: when it fires, the request's clock may read a hair before the
#: deadline. A wait cut this close to the deadline was cut by it.
_AT_DEADLINE = max(0.001, time.get_clock_info("monotonic").resolution)
_NO_GUARD: contextlib.nullcontext[None] = contextlib.nullcontext()  # no throttle or limiter
_LOST = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
_CUTS_KEPT = 1024  # attempts cut per connection whose late answer is still awaited as an orphan


class _NotWritten(TimeoutError):
    """The deadline bounding a write had passed before any byte of the frame was written."""


class _ClosedBeforeWrite(ConnectionResetError):
    """The connection was lost before any byte of the frame was written (it waited for the
    write lock, or found the connection closed): nothing of the request went out."""


class _Waiter:
    __slots__ = ("done", "error", "response")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.response: proto.Response | None = None
        self.error: BaseException | None = None


def _past_deadline(request: Request) -> bool:
    """True once the request's deadline has passed (what cut an attempt at it)."""
    return request.clock() >= request.deadline - _AT_DEADLINE


class _Connection:
    """One TCP connection: a writer lock, and a reader task that hands responses out by opaque.

    A connection is closed, never reused, exactly when:

    * a write to it failed (``send`` raised: the stream is broken or closed);
    * a write was under way when the deadline bounding it (the caller's effective
      deadline, taken when the write starts) passed: part of the frame may be out,
      and what follows on the stream would be read as the rest of it (a peer that
      stops reading gets its connection closed at the deadline). A request whose
      caller was already cancelled, or whose deadline had already passed, when it got
      the write lock writes nothing and leaves the connection open;
    * its byte stream ended, failed or is not the protocol (the reader's
      ``ProtocolError``, or an answer ``check_response`` rejects, see ``_attempt``);
    * a wait for an answer ran into a deadline while nothing at all arrived on it
      since the frame was written (black-holed: the next dispatch connects again);
    * the client is closed.

    A caller cancelled at any other point (a hedge's losing copy, a
    ``move_on_after``) costs only its own attempt: the other requests in flight on
    the connection are still answered.
    """

    def __init__(
        self, stream: anyio.abc.ByteStream, name: str, orphans: OrphanReporter | None = None
    ) -> None:
        self.stream = stream
        self.name = name
        self.orphans = orphans
        # opaque -> (written at, cut at, timeout): attempts cut while the connection lived
        self.cut: dict[int, tuple[float, float, float | None]] = {}
        self.waiting: dict[int, _Waiter] = {}
        self.write_lock = anyio.Lock()
        self.lost: BaseException | None = None
        #: Whether the breaker was told of this connection's loss as one failure for all the
        #: requests it failed in flight (see _Endpoint._attempt).
        self.loss_counted = False
        self.reads = 0  # chunks received so far: unchanged while the connection is silent

    async def read_loop(self) -> None:
        buffer = bytearray()
        try:
            while True:
                buffer += await self.stream.receive()
                self.reads += 1
                while (response := proto.parse_response(buffer)) is not None:
                    waiter = self.waiting.pop(response.opaque, None)
                    if waiter is not None:  # else: its attempt was cut; drop the answer
                        waiter.response = response
                        waiter.done.set()
                    elif self.cut:
                        self._orphan(response)
        except (*_LOST, proto.ProtocolError) as exc:
            self.close(ConnectionResetError(f"connection to {self.name} lost: {exc!r}"))
        finally:
            self.close(ConnectionResetError(f"connection to {self.name} closed"))
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()

    def _orphan(self, response: proto.Response) -> None:
        """Report the late answer to a cut attempt (RFC 67 orphaned response) to ``orphans``."""
        cut = self.cut.pop(response.opaque, None)
        if cut is None or self.orphans is None:
            return
        written, ended, timeout = cut
        try:
            operation = KvOpcode(response.opcode).name.lower()
        except ValueError:
            operation = f"0x{response.opcode:02x}"
        local = self.stream.extra(anyio.abc.SocketAttribute.local_address, None)
        if isinstance(local, tuple):
            host = f"[{local[0]}]" if ":" in str(local[0]) else local[0]
            local = f"{host}:{local[1]}"
        self.orphans.record(
            "kv",
            operation,
            time.monotonic() - written,
            operation_id=f"0x{response.opaque:x}",
            timeout=timeout,
            last_dispatch_duration=ended - written,
            last_remote_socket=self.name,
            last_local_socket=local if isinstance(local, str) else None,
        )

    def close(self, why: BaseException) -> None:
        if self.lost is None:
            self.lost = why
        waiting, self.waiting = self.waiting, {}
        for waiter in waiting.values():
            waiter.error = self.lost
            waiter.done.set()

    async def drop(self, why: str) -> None:
        """Close the connection for good: waiters fail, the reader ends, nothing more is written."""
        self.close(ConnectionResetError(why))
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()

    def _remember_cut(self, opaque: int, written: float, request: Request | None) -> None:
        """Remember an attempt cut after its frame was (or may have been) written.

        Its answer, if it comes while the connection stays open, goes to the orphan
        reporter. At most ``_CUTS_KEPT`` are kept per connection: past that the oldest
        is forgotten (its answer never came, or will not be reported).
        """
        if self.orphans is None or self.lost is not None:
            return
        if len(self.cut) >= _CUTS_KEPT:
            del self.cut[next(iter(self.cut))]  # the oldest: its answer never came
        limit = None if request is None else request.timeout
        timeout = None if limit is None else limit.total_seconds()
        self.cut[opaque] = (written, time.monotonic(), timeout)

    async def _write(self, frame: bytes, opaque: int, request: Request | None) -> None:
        """Write ``frame`` whole, or close the connection (see the class docstring).

        A caller's cancellation never cuts a frame: a hedge's losing copy, or a request
        whose deadline came, is cancelled while its frame is being written, and cutting
        it there would leave half a frame that the next one completes; closing the
        connection for it instead failed every other request in flight on it (one drop
        per lost hedge race, bench/bench_hedge_adaptive.py). So the write is shielded
        from the caller's cancel scopes and bounded by their deadline instead: a peer
        that stops reading until then gets its connection closed.

        Nothing is written, and the connection stays, when the caller is already
        cancelled as it gets here (it raises the cancellation: a lost hedge race, a
        ``move_on_after`` that fired while this waited for the write lock), or when
        the bound has already passed (``_NotWritten``, a ``TimeoutError``). Only a
        cut once the write is under way closes the connection; a bound that passes in
        the instant between that check and ``send``'s first checkpoint is taken for
        such a cut (from outside ``send``, nothing tells whether bytes went out).

        On asyncio, sdkcore's own deadline and hedging cancel the task directly
        (``Task.cancel()``: no scope to shield from); there anyio's ``send`` hands the
        whole frame to the transport in one call, so that cancellation lands before
        the frame or after it, never inside: the connection stays, and the attempt
        is remembered as cut (``opaque``, ``request``), so that its answer, if the
        frame went out, goes to the orphan reporter.
        """
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            dispatch_unsent()  # cancelled before a byte was written
            raise
        bound = anyio.current_effective_deadline()
        if bound <= anyio.current_time():
            raise _NotWritten(
                f"the deadline came before a request frame was written to {self.name}"
            )
        started = time.monotonic()
        try:
            with anyio.CancelScope(deadline=bound, shield=True) as scope:
                await self.stream.send(frame)
        except _LOST as exc:
            await self.drop(f"write to {self.name} failed: {exc!r}")
            return
        except anyio.get_cancelled_exc_class():
            # asyncio's Task.cancel(): before the frame or after it; still waiting: not answered
            if opaque in self.waiting:
                self._remember_cut(opaque, started, request)
            raise
        if scope.cancelled_caught:
            # the deadline came while the peer was not reading: part of the frame may be out
            await self.drop(f"a write to {self.name} was cut mid-frame at the deadline")
            raise TimeoutError(f"{self.name} did not take a request frame before the deadline")

    async def _still_silent(self, silent_since: int) -> bool:
        """Nothing came since ``silent_since``, once the reader has had its turn.

        An answer may be in the socket and its reader woken in the very turn a stalled
        loop cut this wait at the deadline: trio runs the two tasks of a batch in either
        order, so this one may look before the reader counted the bytes."""
        with anyio.CancelScope(shield=True):
            await anyio.lowlevel.checkpoint()
        return self.lost is None and self.reads == silent_since

    async def roundtrip(
        self,
        frame: bytes,
        opaque: int,
        expired: Callable[[], bool],
        request: Request | None = None,
        *,
        silent_for: float | None = None,
    ) -> proto.Response:
        """Write ``frame`` and wait for its response (OSError when the connection is lost).

        ``_NotWritten`` (a ``TimeoutError``) when the deadline had passed before
        anything was written. ``expired()`` says, when the wait is cut, whether a
        deadline cut it; the connection is then closed as black-holed if nothing at
        all came on it since the frame was written, for at least ``silent_for``
        seconds (None: half ``request``'s timeout, 0 without one; a frame written with
        a few milliseconds left says nothing of the connection). An attempt cut after its frame was
        written, on a connection that stays open, is remembered (with ``request``'s
        timeout), so its late answer goes to the client's orphan reporter.
        """
        if self.lost is not None:
            raise _ClosedBeforeWrite(f"connection to {self.name} is closed")
        waiter = _Waiter()
        self.waiting[opaque] = waiter
        try:
            try:
                await self.write_lock.acquire()
            except BaseException:
                # Cut while waiting for the lock (its deadline, a lost hedge race): nothing
                # of it was written, and the door books it so (a SET's timeout unambiguous).
                dispatch_unsent()
                raise
            try:
                if self.lost is not None:  # closed while this waited for the lock: not written
                    raise _ClosedBeforeWrite(
                        f"connection to {self.name} closed before the request was written"
                    ) from self.lost
                await self._write(frame, opaque, request)
            finally:
                self.write_lock.release()
            silent_since = self.reads
            sent_at = time.monotonic()
            try:
                await waiter.done.wait()
            except BaseException:
                if self.lost is None and self.reads == silent_since and expired():
                    if silent_for is None:
                        timeout = None if request is None else request.timeout
                        silent_for = 0.0 if timeout is None else timeout.total_seconds() / 2
                    if time.monotonic() - sent_at >= silent_for and await self._still_silent(
                        silent_since
                    ):
                        silent_ms = (time.monotonic() - sent_at) * 1000.0
                        whose = "a request's" if request is None else f"request {request.id}'s"
                        # every request waiting on it fails with this: say whose deadline
                        await self.drop(
                            f"connection to {self.name} closed: no byte from it for "
                            f"{silent_ms:.0f} ms, until {whose} deadline"
                        )
                if not waiter.done.is_set():
                    self._remember_cut(opaque, sent_at, request)
                raise
        finally:
            self.waiting.pop(opaque, None)
        if waiter.error is not None:
            raise waiter.error
        assert waiter.response is not None
        return waiter.response


class _Endpoint:
    """One memcached server: its breaker and its (single, lazily opened) connection."""

    def __init__(
        self,
        address: Address,
        breaker: CircuitBreaker,
        client: MemcachedClient,
        limiter: Limiter | None = None,
        throttle: AdaptiveThrottle | None = None,
    ) -> None:
        self.address = address
        self.name = f"{address[0]}:{address[1]}"
        self.breaker = breaker
        self.limiter = limiter
        self.throttle = throttle
        self._client = client
        self._connection: _Connection | None = None
        self._connect_lock = anyio.Lock()

    async def _connect(self) -> _Connection:
        connection = self._connection
        if connection is not None and connection.lost is None:
            return connection
        async with self._connect_lock:
            connection = self._connection
            if connection is None or connection.lost is not None:
                stream = await anyio.connect_tcp(*self.address)
                try:
                    connection = _Connection(stream, self.name, self._client._orphans)
                    self._client._start(connection)  # RuntimeError outside 'async with'
                except BaseException:
                    # no reader for it: closed now, not left open for as long as the
                    # error's traceback lives (a review counted one socket per refusal)
                    with anyio.CancelScope(shield=True):
                        await stream.aclose()
                    raise
                self._connection = connection
        return connection

    async def dispatch(
        self, request: Request, opcode: KvOpcode, build: Callable[[int], bytes]
    ) -> proto.Response:
        """One attempt: breaker guard, NOOP canary when probing, then the request itself."""
        if refuse_if_open(self.breaker):
            await self._canary(request)
        return await self._attempt(request, opcode, build)

    async def send(
        self, request: Request, opcode: KvOpcode, build: Callable[[int], bytes]
    ) -> proto.Response:
        """One attempt in rfc/0009's order: throttle, limiter, breaker, then the dispatch.

        The server's status is mapped inside the guards, so the throttle counts a
        TMPFAIL as a rejection and the adaptive limiter times the answer.
        """
        throttle, limiter = self.throttle, self.limiter
        with throttle.guard() if throttle is not None else _NO_GUARD:
            async with limiter.acquire() if limiter is not None else _NO_GUARD:
                response = await self.dispatch(request, opcode, build)
                raise_for_status(response, opcode)
                return response

    async def _canary(self, request: Request) -> None:
        bound = canary_bound(self.breaker, request.dispatch_info().time_left)
        until = anyio.current_time() + bound

        def expired() -> bool:
            return anyio.current_time() >= until or _past_deadline(request)

        try:
            with anyio.CancelScope(deadline=until) as scope:
                connection = await self._connect()
                opaque = self._client._opaque()
                await connection.roundtrip(
                    proto.noop_frame(opaque),
                    opaque,
                    expired,
                    # half the canary's own bound: its request's time left may be far below
                    # canary_timeout, and a canary cut at its bound must still close a
                    # connection that never answered, or no probe ever replaces it
                    silent_for=bound / 2,
                )
            if scope.cancelled_caught:
                raise TimeoutError(f"no NOOP answer from {self.name} within the canary's bound")
        except (TimeoutError, OSError) as exc:
            self.breaker.record_failure(exc)
            canary_failed(self.breaker, exc)
        except anyio.get_cancelled_exc_class() as exc:
            self.breaker.record_failure(exc)  # a timeout if the request's deadline cut it
            raise
        # any answer, whatever its status, shows the server is alive
        self.breaker.record_success()

    async def _attempt(
        self, request: Request, opcode: KvOpcode, build: Callable[[int], bytes]
    ) -> proto.Response:
        breaker = self.breaker
        try:
            connection = await self._connect()
        except OSError as exc:
            breaker.record_failure(exc)
            raise RetryableError(
                RetryReason.SOCKET_NOT_AVAILABLE, f"cannot connect to {self.name}"
            ) from exc
        except anyio.get_cancelled_exc_class() as exc:
            dispatch_unsent()  # cut while connecting: nothing of the request was written
            breaker.record_failure(exc)  # a timeout if the request's deadline cut it
            raise
        opaque = self._client._opaque()
        try:
            response = await connection.roundtrip(
                build(opaque), opaque, lambda: _past_deadline(request), request
            )
        except (_NotWritten, _ClosedBeforeWrite) as exc:
            # Nothing was written and the endpoint was not asked: no outcome for the
            # breaker (as the sync client's "no time left to send"), and any request may
            # retry (NOT_SENT); a deadline that passed cancels it at its next checkpoint.
            raise RetryableError(
                RetryReason.SOCKET_NOT_AVAILABLE, f"{exc}; nothing was sent"
            ) from exc
        except OSError as exc:
            if not connection.loss_counted:
                # A connection that had answered (the server was alive) is lost once: one
                # failure of the endpoint for every request it failed in flight, or one
                # reset of a healthy server with 20 requests out would open the breaker.
                # One that never answered (a dead server behind a proxy that accepts and
                # drops) counts each request, as a refused connect does.
                connection.loss_counted = connection.reads > 0
                breaker.record_failure(exc)
            raise RetryableError(
                RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT,
                f"connection to {self.name} closed while the request was in flight",
            ) from exc
        except anyio.get_cancelled_exc_class() as exc:
            breaker.record_failure(exc)  # a timeout if the request's deadline cut it
            raise
        breaker.record_success()
        try:
            proto.check_response(response, opcode)
        except proto.ProtocolError as exc:
            await connection.drop(f"{self.name} broke the protocol: {exc}")
            raise
        return response

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.drop(f"client closed the connection to {self.name}")


def _only(group: BaseException, error: BaseException) -> bool:
    """True when ``group`` is an exception group of ``error`` and, besides it, cancellations."""
    if getattr(group, "exceptions", None) is None:
        return False
    leaves: list[BaseException] = []
    stack = [group]
    while stack:
        inners = getattr(stack.pop(), "exceptions", None)
        for inner in inners or ():
            (stack if getattr(inner, "exceptions", None) is not None else leaves).append(inner)
    cancelled = anyio.get_cancelled_exc_class()
    return any(leaf is error for leaf in leaves) and all(
        leaf is error or isinstance(leaf, cancelled) for leaf in leaves
    )


class MemcachedClient(EndpointGuards):
    """GET, SET, ADD, INCR, DELETE and NOOP over the binary protocol, with sdkcore deciding retries.

    Use it as an async context manager (it owns one reader task per connection)::

        async with MemcachedClient(["127.0.0.1:11211"], orchestrator=RetryOrchestrator(
            BestEffortRetryStrategy())) as client:
            await client.set("k", b"v")
            assert await client.get("k") == b"v"

    * ``orchestrator``: runs every operation (default: a new ``RetryOrchestrator()``).
      Give it a shared one to share its backpressure and its retry budget
      (``RetryOrchestrator(retry_budget=...)``) between clients.
    * ``timeout`` and ``retry_strategy``: for every :class:`~sdkcore.Request`.
    * ``breaker``: makes the breaker of an endpoint from its name ``"host:port"``
      (default :func:`make_breaker`).
    * ``limiter``: a :class:`~sdkcore.ConcurrencyLimiter` or
      :class:`~sdkcore.AdaptiveConcurrencyLimiter` per endpoint, or a callable making
      one from the endpoint's name ``"host:port"`` (a limiter object is taken only
      with a single endpoint). Each dispatch holds a permit (``acquire()``: it waits
      in the limiter's queue if ``max_queued`` allows); a refusal is ``NOT_SENT`` and
      retried by the strategy. Default: none.
    * ``throttle``: an :class:`~sdkcore.AdaptiveThrottle` per endpoint (or a callable
      making one from the name, as ``limiter``): requests are refused locally while
      the server answers TMPFAIL (rfc/0009). Default: none.

      Per dispatch the order is rfc/0009's: throttle, limiter, breaker, send.
    * ``orphan_reporter``: a :class:`~sdkcore.OrphanReporter` that gets the answers
      arriving for attempts that were cut (timed out or cancelled) after their frame
      was written, while their connection stayed open (rfc/0008). Each connection
      remembers at most 1024 such attempts at a time: past that the oldest is
      forgotten and its answer, if it ever comes, is not reported. An answer that had
      already reached its attempt when the attempt was cut is not an orphan.

    Keys go to endpoints by crc32. Server statuses are mapped by
    :func:`sdkcore.mapping.kv_failure`; a GET of a missing key raises
    ``DocumentNotFoundException``.
    """

    def __init__(
        self,
        endpoints: str | Address | Sequence[str | Address],
        *,
        orchestrator: RetryOrchestrator | None = None,
        timeout: timedelta | float = timedelta(milliseconds=2500),
        retry_strategy: RetryStrategy | None = None,
        breaker: BreakerFactory = make_breaker,
        clock: Callable[[], float] | None = None,
        orphan_reporter: OrphanReporter | None = None,
        limiter: Limiter | Callable[[str], Limiter] | None = None,
        throttle: AdaptiveThrottle | Callable[[str], AdaptiveThrottle] | None = None,
    ) -> None:
        if orphan_reporter is not None and not isinstance(orphan_reporter, OrphanReporter):
            raise TypeError(
                "MemcachedClient(orphan_reporter) must be an sdkcore.OrphanReporter or None, "
                f"got {orphan_reporter!r}"
            )
        self._orphans = orphan_reporter
        self._orchestrator = RetryOrchestrator() if orchestrator is None else orchestrator
        self._request_kwargs: dict[str, Any] = {"timeout": timeout}
        if retry_strategy is not None:
            self._request_kwargs["retry_strategy"] = retry_strategy
        if clock is not None:
            self._request_kwargs["clock"] = clock
        kv_request(KvOpcode.NOOP, **self._request_kwargs)  # check the settings now
        self._endpoints: list[_Endpoint] = [
            _Endpoint(address, breaker_, self, limiter_, throttle_)
            for address, breaker_, limiter_, throttle_ in endpoint_guards(
                "MemcachedClient", endpoints_of(endpoints), breaker, limiter, throttle
            )
        ]
        self._opaques = itertools.count(1)
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> MemcachedClient:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        for endpoint in self._endpoints:
            await endpoint.aclose()
        tg.cancel_scope.cancel()
        try:
            return await tg.__aexit__(exc_type, exc, tb)
        except BaseException as raised:
            # trio's nursery wraps what the block raised in a group: let it out plain
            if exc is None or raised is exc or not _only(raised, exc):
                raise
        return None

    def _start(self, connection: _Connection) -> None:
        if self._tg is None:
            raise RuntimeError("use MemcachedClient as 'async with MemcachedClient(...) as c'")
        self._tg.start_soon(connection.read_loop)

    def _opaque(self) -> int:
        return next(self._opaques) & 0xFFFFFFFF

    async def _run(
        self, opcode: KvOpcode, key: bytes | str | None, build: Callable[[int], bytes]
    ) -> proto.Response:
        endpoint = self._endpoints[0 if key is None else pick(key, len(self._endpoints))]
        request = kv_request(opcode, **self._request_kwargs)

        async def send(request: Request) -> proto.Response:
            return await endpoint.send(request, opcode, build)

        return await self._orchestrator.execute(request, send)

    # -- the commands ----------------------------------------------------------------
    async def get(self, key: bytes | str) -> bytes:
        """The value of ``key`` (DocumentNotFoundException when missing). Idempotent."""
        response = await self._run(KvOpcode.GET, key, lambda o: proto.get_frame(o, key))
        return response.value

    async def set(self, key: bytes | str, value: bytes, *, flags: int = 0, expiry: int = 0) -> int:
        """Store ``value`` (upsert); returns the new CAS. Not idempotent (RFC 0049)."""
        response = await self._run(
            KvOpcode.SET, key, lambda o: proto.set_frame(o, key, value, flags=flags, expiry=expiry)
        )
        return response.cas

    async def add(self, key: bytes | str, value: bytes, *, flags: int = 0, expiry: int = 0) -> int:
        """Store ``value`` only if ``key`` is missing (DocumentExistsException otherwise)."""
        response = await self._run(
            KvOpcode.ADD, key, lambda o: proto.add_frame(o, key, value, flags=flags, expiry=expiry)
        )
        return response.cas

    async def incr(self, key: bytes | str, delta: int = 1, *, initial: int = 0) -> int:
        """Add ``delta`` to the counter (created at ``initial``); returns the new value."""
        response = await self._run(
            KvOpcode.INCREMENT, key, lambda o: proto.incr_frame(o, key, delta, initial=initial)
        )
        return proto.counter(response)

    async def delete(self, key: bytes | str) -> None:
        """Remove ``key`` (DocumentNotFoundException when missing)."""
        await self._run(KvOpcode.DELETE, key, lambda o: proto.delete_frame(o, key))

    async def noop(self, endpoint: int = 0) -> None:
        """A NOOP to the ``endpoint``-th server (a health check). Idempotent."""
        target = self._endpoints[endpoint]
        request = kv_request(KvOpcode.NOOP, **self._request_kwargs)

        async def send(request: Request) -> None:
            await target.send(request, KvOpcode.NOOP, proto.noop_frame)

        await self._orchestrator.execute(request, send)
