"""The blocking memcached client: the same dispatch rules through ``execute_sync`` (threads).

One socket per endpoint, shared by threads under a lock: a request holds the
connection from its write to its response (no pipelining; the async client
pipelines). Every socket operation is bounded by the request's time left.
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sdkcore import (
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
    canary_bound,
    canary_failed,
    endpoints_of,
    make_breaker,
    pick,
    raise_for_status,
    refuse_if_open,
)

__all__ = ["SyncMemcachedClient"]


def _seconds(left: timedelta | None) -> float | None:
    return None if left is None else max(left.total_seconds(), 0.0)


class _SyncEndpoint:
    def __init__(self, address: Address, breaker: CircuitBreaker) -> None:
        self.address = address
        self.name = f"{address[0]}:{address[1]}"
        self.breaker = breaker
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _connect(self, timeout: float | None) -> socket.socket:
        """The endpoint's socket, connected if needed (OSError: nothing was sent)."""
        if self._sock is None:
            sock = socket.create_connection(self.address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _roundtrip(self, frame: bytes, opaque: int, timeout: float | None) -> proto.Response:
        """Write and read one frame on the connected, locked socket (OSError, TimeoutError)."""
        sock = self._connect(timeout)
        sock.settimeout(timeout)
        try:
            sock.sendall(frame)
            buffer = bytearray()
            while True:
                response = proto.parse_response(buffer)
                if response is not None:
                    if response.opaque == opaque:
                        return response
                    continue  # an answer to an attempt that gave up: skip it
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError(f"{self.name} closed the connection")
                buffer += chunk
        except BaseException:
            self._drop()  # a half-read stream cannot be reused
            raise

    def dispatch(
        self, request: Request, build: Callable[[int], bytes], opaque: int
    ) -> proto.Response:
        breaker = self.breaker
        probe = refuse_if_open(breaker)
        wait = _seconds(request.time_left)
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            raise RetryableError(
                RetryReason.SOCKET_NOT_AVAILABLE, f"connection to {self.name} is busy"
            )
        try:
            if _seconds(request.time_left) == 0.0:  # nothing sent: execute_sync times out
                raise RetryableError(RetryReason.SOCKET_NOT_AVAILABLE, "no time left to send")
            if probe:
                try:
                    self._roundtrip(
                        proto.noop_frame(opaque), opaque, canary_bound(breaker, request.time_left)
                    )
                except OSError as exc:  # socket timeouts are TimeoutError, an OSError
                    breaker.record_failure(exc)
                    canary_failed(breaker, exc)
                breaker.record_success()
            left = _seconds(request.time_left)
            if left == 0.0:  # the canary took the rest: nothing sent
                raise RetryableError(RetryReason.SOCKET_NOT_AVAILABLE, "no time left to send")
            try:
                self._connect(left)
            except OSError as exc:
                breaker.record_failure(exc)
                raise RetryableError(
                    RetryReason.SOCKET_NOT_AVAILABLE, f"cannot connect to {self.name}: {exc}"
                ) from exc
            try:
                response = self._roundtrip(build(opaque), opaque, left)
            except OSError as exc:  # written (or maybe written): it may have been applied
                breaker.record_failure(exc)
                raise RetryableError(
                    RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, f"{self.name}: {exc}"
                ) from exc
            breaker.record_success()
            return response
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._drop()


class SyncMemcachedClient:
    """:class:`~sdkcore.examples.memcached.MemcachedClient` for threads (``execute_sync``).

    Same commands, settings and rules; blocking calls. Close it with :meth:`close`
    or use it as a context manager.
    """

    def __init__(
        self,
        endpoints: str | Address | Sequence[str | Address],
        *,
        orchestrator: RetryOrchestrator | None = None,
        timeout: timedelta | float = timedelta(milliseconds=2500),
        retry_strategy: RetryStrategy | None = None,
        breaker: BreakerFactory = make_breaker,
    ) -> None:
        self._orchestrator = RetryOrchestrator() if orchestrator is None else orchestrator
        self._request_kwargs: dict[str, Any] = {"timeout": timeout}
        if retry_strategy is not None:
            self._request_kwargs["retry_strategy"] = retry_strategy
        kv_request(KvOpcode.NOOP, **self._request_kwargs)  # check the settings now
        self._endpoints = [
            _SyncEndpoint(address, breaker(f"{address[0]}:{address[1]}"))
            for address in endpoints_of(endpoints)
        ]
        self._opaques = itertools.count(1)
        self._opaque_lock = threading.Lock()

    @property
    def breakers(self) -> list[CircuitBreaker]:
        return [endpoint.breaker for endpoint in self._endpoints]

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
            response = endpoint.dispatch(request, build, opaque)
            raise_for_status(response, opcode)
            return response

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
        return int(struct.unpack(">Q", response.value)[0])

    def delete(self, key: bytes | str) -> None:
        self._run(KvOpcode.DELETE, key, lambda o: proto.delete_frame(o, key))

    def noop(self, endpoint: int = 0) -> None:
        target = self._endpoints[endpoint]
        request = kv_request(KvOpcode.NOOP, **self._request_kwargs)

        def send(request: Request) -> None:
            with self._opaque_lock:
                opaque = next(self._opaques) & 0xFFFFFFFF
            raise_for_status(target.dispatch(request, proto.noop_frame, opaque), KvOpcode.NOOP)

        self._orchestrator.execute_sync(request, send)
