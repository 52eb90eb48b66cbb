"""The blocking memcached client: the same dispatch rules through ``execute_sync`` (threads).

One socket per endpoint, shared by threads under a lock: a request holds the
connection from its write to its response (no pipelining; the async client
pipelines). Every socket operation is bounded by the time left until the
request's deadline, and a socket whose exchange was cut is closed. Each dispatch
goes through the endpoint's throttle, limiter and breaker in rfc/0009's order.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sdkcore import (
    AdaptiveThrottle,
    CircuitBreaker,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
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

__all__ = ["SyncMemcachedClient"]


_NO_GUARD: contextlib.nullcontext[None] = contextlib.nullcontext()  # no throttle or limiter
_HAS_POLL = hasattr(select, "poll")


def _deadline(request: Request) -> float | None:
    """The request's deadline on ``time.monotonic`` (None: none).

    From ``dispatch_info().time_left``, which holds a deadline inherited from an
    enclosing request (a client built with ``timeout=None`` inside another request's
    ``send`` keeps within that request's deadline).
    """
    left = request.dispatch_info().time_left
    return None if left is None else time.monotonic() + left


#: The longest wait the OS takes (``Lock.acquire``, ``socket.settimeout``).
_FOREVER = threading.TIMEOUT_MAX


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` for one socket operation (TimeoutError once none is left)."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0.0:
        raise TimeoutError("the deadline passed")
    # A timeout Request takes (up to ~2.7 million years) overflows the OS's waits past
    # threading.TIMEOUT_MAX (~292 years): such a wait is the same as the longest one.
    return left if left < _FOREVER else _FOREVER


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer closed (or reset) the idle ``sock``: nothing may be sent on it.

    The cost on the success path is one readiness check that does not wait (``poll``
    with a zero timeout, about a microsecond; ``select`` where there is no ``poll``,
    Windows: ``select`` fails on descriptors past 1023 elsewhere). An idle socket of
    this client is not readable (every exchange reads its answer whole, and a cut one
    closes the socket), so only a readable one is peeked at: end of stream (b"") or an
    error means closed. Unexpected bytes leave it open: the read skips them.
    """
    try:
        if _HAS_POLL:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            if not poller.poll(0):
                return False
        elif not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # reset by the peer, or not a usable socket any more
        return True


class _NotWritten(TimeoutError):
    """The deadline passed before any byte of the frame was written (the socket stays)."""


class _SyncEndpoint:
    def __init__(
        self,
        address: Address,
        breaker: CircuitBreaker,
        limiter: Limiter | None = None,
        throttle: AdaptiveThrottle | None = None,
    ) -> None:
        self.address = address
        self.name = f"{address[0]}:{address[1]}"
        self.breaker = breaker
        self.limiter = limiter
        self.throttle = throttle
        # An RLock: release() refuses a thread that does not hold it, so the dispatch's
        # finally releases only what it took, also when an interrupt came between acquire()
        # returning and its try. No user code runs while it is held (no dispatch nests).
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None

    def send(
        self, request: Request, opcode: KvOpcode, build: Callable[[int], bytes], opaque: int
    ) -> proto.Response:
        """One attempt in rfc/0009's order: throttle, limiter, then :meth:`dispatch`.

        :meth:`dispatch` takes the connection, then asks the breaker. The limiter's
        ``guard()`` never waits (a refusal is ``NOT_SENT``; waiting is the strategy's
        backoff). The server's status is mapped inside the guards, so the throttle
        counts a TMPFAIL as a rejection and the adaptive limiter times the answer.
        The ``with`` blocks give the permit back however the attempt ends.
        """
        throttle, limiter = self.throttle, self.limiter
        with (
            throttle.guard() if throttle is not None else _NO_GUARD,
            limiter.guard() if limiter is not None else _NO_GUARD,
        ):
            response = self.dispatch(request, opcode, build, opaque)
            raise_for_status(response, opcode)
            return response

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _connect(self, deadline: float | None, *, check: bool = True) -> socket.socket:
        """The endpoint's socket, connected if needed (OSError: nothing was sent).

        With ``check``, a pooled socket the server closed meanwhile (memcached
        restarted, an idle timeout) is closed and replaced before anything is sent on
        it: else the request would be written to it, its answer read as b"", and a
        request that never reached the server reported as maybe applied. ``check=False``
        only right after a checked ``_connect`` under the same hold of the lock.
        """
        if check and self._sock is not None and _closed_by_peer(self._sock):
            self._drop()
        if self._sock is None:
            sock = socket.create_connection(self.address, timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _roundtrip(
        self, frame: bytes, opaque: int, deadline: float | None, *, check: bool = True
    ) -> proto.Response:
        """Write and read one frame on the locked socket (OSError, TimeoutError).

        ``check``: passed to :meth:`_connect` (False when the caller has just connected).

        Each socket operation gets only the time left until ``deadline``, so a server
        that trickles its answer cannot hold the request past it. Whatever cuts the
        exchange (a timeout, a lost connection, a broken stream, an interrupt) closes
        the socket: a half-written or half-read stream is never reused. A stream that
        is not the protocol raises ``ConnectionResetError`` (as the async client's
        reader does), so the breaker and the canary count it as the endpoint failing.
        """
        try:
            sock = self._connect(deadline, check=check)
        except BaseException:
            self._drop()
            raise
        try:
            first = _left(deadline)
        except TimeoutError as exc:  # nothing written: the socket is as good as before
            raise _NotWritten(
                f"the deadline came before a frame was written to {self.name}"
            ) from exc
        try:
            sock.settimeout(first)
            sock.sendall(frame)  # the timeout bounds the whole sendall
            buffer = bytearray()
            while True:
                response = proto.parse_response(buffer)
                if response is not None:
                    if response.opaque == opaque:
                        return response
                    continue  # an answer to an attempt that gave up: skip it
                sock.settimeout(_left(deadline))
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError(f"{self.name} closed the connection")
                buffer += chunk
        except proto.ProtocolError as exc:
            self._drop()
            raise ConnectionResetError(f"{self.name} broke the protocol: {exc}") from exc
        except BaseException:
            self._drop()
            raise

    def dispatch(
        self, request: Request, opcode: KvOpcode, build: Callable[[int], bytes], opaque: int
    ) -> proto.Response:
        breaker = self.breaker
        deadline = _deadline(request)
        wait = None if deadline is None else min(max(deadline - time.monotonic(), 0.0), _FOREVER)
        # The connection first, then the breaker: a probe is taken only by a dispatch
        # that can send it now, never held while this thread waits for the lock.
        try:
            if not self._lock.acquire(timeout=-1 if wait is None else wait):
                raise RetryableError(
                    RetryReason.SOCKET_NOT_AVAILABLE, f"connection to {self.name} is busy"
                )
            if deadline is not None and time.monotonic() >= deadline:
                # nothing sent: execute_sync times out
                raise RetryableError(RetryReason.SOCKET_NOT_AVAILABLE, "no time left to send")
            if refuse_if_open(breaker):
                self._canary(deadline, opaque)
            if deadline is not None and time.monotonic() >= deadline:
                # the canary took the rest: nothing sent
                raise RetryableError(RetryReason.SOCKET_NOT_AVAILABLE, "no time left to send")
            try:
                self._connect(deadline)
            except OSError as exc:
                breaker.record_failure(exc)
                raise RetryableError(
                    RetryReason.SOCKET_NOT_AVAILABLE, f"cannot connect to {self.name}: {exc}"
                ) from exc
            try:
                # connected (and checked) just above: one select per request, not two
                response = self._roundtrip(build(opaque), opaque, deadline, check=False)
            except _NotWritten as exc:  # no outcome for the breaker: nothing was sent
                raise RetryableError(
                    RetryReason.SOCKET_NOT_AVAILABLE, f"{exc}; nothing was sent"
                ) from exc
            except OSError as exc:  # written (or maybe written): it may have been applied
                breaker.record_failure(exc)
                raise RetryableError(
                    RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, f"{self.name}: {exc}"
                ) from exc
            breaker.record_success()
            try:
                proto.check_response(response, opcode)
            except proto.ProtocolError:
                self._drop()  # a server that answers out of protocol: not reused
                raise
            return response
        finally:
            # an RLock: released only by the thread that holds it, including one an
            # interrupt reached between acquire() returning and this try
            # no call before release() (contextlib.suppress is one): a pending interrupt is
            # raised at a call
            try:  # noqa: SIM105
                self._lock.release()
            except RuntimeError:  # not held by this thread (the wait timed out)
                pass

    def _canary(self, deadline: float | None, opaque: int) -> None:
        """The probe: a NOOP bounded by ``canary_timeout`` and the deadline; any answer closes."""
        breaker = self.breaker
        bound = canary_bound(breaker, None if deadline is None else deadline - time.monotonic())
        try:
            self._roundtrip(proto.noop_frame(opaque), opaque, time.monotonic() + bound)
        except OSError as exc:  # socket timeouts are TimeoutError, an OSError
            breaker.record_failure(exc)
            canary_failed(breaker, exc)
        except (KeyboardInterrupt, SystemExit) as exc:  # the caller's interrupt: no outcome,
            breaker.record_failure(exc)  # the probe free again (rfc/0007), as the async client's
            raise
        breaker.record_success()

    def close(self) -> None:
        with self._lock:
            self._drop()


class SyncMemcachedClient(EndpointGuards):
    """:class:`~sdkcore.examples.memcached.MemcachedClient` for threads (``execute_sync``).

    Same commands and rules; blocking calls. Close it with :meth:`close` or use it
    as a context manager. Thread-safe: threads may share one client.

    The same settings (``orchestrator``, ``timeout``, ``retry_strategy``,
    ``breaker``, ``limiter``, ``throttle``) except:

    * no ``orphan_reporter``: an exchange that is cut closes its socket, so no answer
      can arrive late on a connection that stays open;
    * no ``clock``: its requests, and the bounds of its socket operations, are on
      ``time.monotonic``;
    * ``limiter`` never queues (below).

    * ``limiter``: a :class:`~sdkcore.ConcurrencyLimiter` or
      :class:`~sdkcore.AdaptiveConcurrencyLimiter` per endpoint, or a callable making
      one from the endpoint's name ``"host:port"`` (a limiter object is taken only
      with a single endpoint). Each dispatch holds a permit (``guard()``: no queue,
      the limiter's ``max_queued`` does not apply) from before it waits for the
      endpoint's connection until its answer is read; a refusal is ``NOT_SENT`` and
      retried by the strategy. Default: none.
    * ``throttle``: an :class:`~sdkcore.AdaptiveThrottle` per endpoint (or a callable
      making one from the name, as ``limiter``): requests are refused locally while
      the server answers TMPFAIL (rfc/0009). Default: none.

      Per dispatch the order is rfc/0009's: throttle, limiter, (connection,) breaker,
      send.
    """

    def __init__(
        self,
        endpoints: str | Address | Sequence[str | Address],
        *,
        orchestrator: RetryOrchestrator | None = None,
        timeout: timedelta | float = timedelta(milliseconds=2500),
        retry_strategy: RetryStrategy | None = None,
        breaker: BreakerFactory = make_breaker,
        limiter: Limiter | Callable[[str], Limiter] | None = None,
        throttle: AdaptiveThrottle | Callable[[str], AdaptiveThrottle] | None = None,
    ) -> None:
        self._orchestrator = RetryOrchestrator() if orchestrator is None else orchestrator
        self._request_kwargs: dict[str, Any] = {"timeout": timeout}
        if retry_strategy is not None:
            self._request_kwargs["retry_strategy"] = retry_strategy
        kv_request(KvOpcode.NOOP, **self._request_kwargs)  # check the settings now
        self._endpoints: list[_SyncEndpoint] = [
            _SyncEndpoint(address, breaker_, limiter_, throttle_)
            for address, breaker_, limiter_, throttle_ in endpoint_guards(
                "SyncMemcachedClient", endpoints_of(endpoints), breaker, limiter, throttle
            )
        ]
        self._opaques = itertools.count(1)
        self._opaque_lock = threading.Lock()

    def __enter__(self) -> SyncMemcachedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for endpoint in self._endpoints:
            endpoint.close()

    def _run(
        self, opcode: KvOpcode, key: bytes | str | None, build: Callable[[int], bytes]
    ) -> proto.Response:
        endpoint = self._endpoints[0 if key is None else pick(key, len(self._endpoints))]
        request = kv_request(opcode, **self._request_kwargs)

        def send(request: Request) -> proto.Response:
            with self._opaque_lock:
                opaque = next(self._opaques) & 0xFFFFFFFF
            return endpoint.send(request, opcode, build, opaque)

        return self._orchestrator.execute_sync(request, send)

    def get(self, key: bytes | str) -> bytes:
        return self._run(KvOpcode.GET, key, lambda o: proto.get_frame(o, key)).value

    def set(self, key: bytes | str, value: bytes, *, flags: int = 0, expiry: int = 0) -> int:
        build = lambda o: proto.set_frame(o, key, value, flags=flags, expiry=expiry)  # noqa: E731
        return self._run(KvOpcode.SET, key, build).cas

    def add(self, key: bytes | str, value: bytes, *, flags: int = 0, expiry: int = 0) -> int:
        build = lambda o: proto.add_frame(o, key, value, flags=flags, expiry=expiry)  # noqa: E731
        return self._run(KvOpcode.ADD, key, build).cas

    def incr(self, key: bytes | str, delta: int = 1, *, initial: int = 0) -> int:
        response = self._run(
            KvOpcode.INCREMENT, key, lambda o: proto.incr_frame(o, key, delta, initial=initial)
        )
        return proto.counter(response)

    def delete(self, key: bytes | str) -> None:
        self._run(KvOpcode.DELETE, key, lambda o: proto.delete_frame(o, key))

    def noop(self, endpoint: int = 0) -> None:
        target = self._endpoints[endpoint]
        request = kv_request(KvOpcode.NOOP, **self._request_kwargs)

        def send(request: Request) -> None:
            with self._opaque_lock:
                opaque = next(self._opaques) & 0xFFFFFFFF
            target.send(request, KvOpcode.NOOP, proto.noop_frame, opaque)

        self._orchestrator.execute_sync(request, send)
