"""Test helpers: a real grpc.aio server on 127.0.0.1 (port 0) with per-test generic handlers,
and client scenarios more than one test file plays against it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402

from sdkcore.grpc import (  # noqa: E402
    BackoffJitter,
    _throttle,
    insecure_channel,
    retry_controller,
)
from sdkcore.grpc._target import server_name  # noqa: E402

Handler = Callable[..., Awaitable[Any]] | Callable[..., AsyncIterator[Any]]

#: Every end-to-end test fails instead of hanging after this many seconds.
TEST_TIMEOUT = 15.0


#: Server-side pause between sending headers and failing, in tests about header commit.
#: If the status is queued before the headers are flushed, the transport may send one
#: trailers-only response, which A6 (and grpc C-core) rightly do not treat as a commit;
#: the pause makes the headers go out on their own. It sets up the scenario; no test
#: asserts anything about time.
HEADERS_FLUSH = 0.05


class Passthrough(aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """An application interceptor that hands every attempt on (``calls``: how many)."""

    def __init__(self) -> None:
        self.calls = 0

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.calls += 1
        return await continuation(details, request)


class _PassUnaryStream(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(details, request)


class _PassStreamUnary(aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(details, requests)


class _PassStreamStream(aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(details, requests)


def pass_through() -> list[Any]:
    """Application interceptors that hand every call on (an auth or logging one, say), one
    per call shape: grpc.aio files an interceptor under the first shape it is an instance
    of, so one class for the four would intercept unary-unary calls only."""
    return [Passthrough(), _PassUnaryStream(), _PassStreamUnary(), _PassStreamStream()]


def server_task(task: asyncio.Task[Any]) -> bool:
    """A task of grpc.aio's server (it ends its RPCs' tasks in its own time): not a leak of
    the client's."""
    name = task.get_name()
    return (
        name == "rpc_task"
        or name.startswith("HandleExceptions[")
        or task.get_coro().__qualname__ == "AioServer._request_call"  # type: ignore[union-attr]
    )


def retry_config(
    *,
    max_attempts: int = 3,
    initial: str = "0.01s",
    maximum: str = "0.05s",
    multiplier: float = 2,
    codes: tuple[str, ...] = ("ABORTED", "UNAVAILABLE"),
    throttling: dict[str, Any] | None = None,
    timeout: str | None = None,
) -> str:
    mc: dict[str, Any] = {
        "name": [{"service": "test.Svc"}],
        "retryPolicy": {
            "maxAttempts": max_attempts,
            "initialBackoff": initial,
            "maxBackoff": maximum,
            "backoffMultiplier": multiplier,
            "retryableStatusCodes": list(codes),
        },
    }
    return config_json(mc, timeout=timeout, throttling=throttling)


def config_json(mc: dict[str, Any], *, timeout: str | None, throttling: Any) -> str:
    """A service config of one method config ``mc``, with its timeout and throttling."""
    if timeout is not None:
        mc["timeout"] = timeout
    cfg: dict[str, Any] = {"methodConfig": [mc]}
    if throttling is not None:
        cfg["retryThrottling"] = throttling
    return json.dumps(cfg)


class Server:
    """Handlers by method name; records the invocation metadata of every attempt."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.attempts: dict[str, list[dict[str, str]]] = {}
        self.port = 0
        self._server: Any = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _record(self, name: str, context: Any) -> int:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        seen = self.attempts.setdefault(name, [])
        seen.append(md)
        return len(seen)

    def unary_unary(self, name: str, fn: Callable[[bytes, Any, int], Awaitable[bytes]]) -> str:
        async def handler(request: bytes, context: Any) -> bytes:
            return await fn(request, context, self._record(name, context))

        self.handlers[name] = grpc.unary_unary_rpc_method_handler(handler)
        return f"/test.Svc/{name}"

    def unary_stream(self, name: str, fn: Callable[[bytes, Any, int], AsyncIterator[bytes]]) -> str:
        async def handler(request: bytes, context: Any) -> AsyncIterator[bytes]:
            async for item in fn(request, context, self._record(name, context)):
                yield item

        self.handlers[name] = grpc.unary_stream_rpc_method_handler(handler)
        return f"/test.Svc/{name}"

    def stream_unary(
        self, name: str, fn: Callable[[AsyncIterator[bytes], Any, int], Awaitable[bytes]]
    ) -> str:
        async def handler(requests: AsyncIterator[bytes], context: Any) -> bytes:
            return await fn(requests, context, self._record(name, context))

        self.handlers[name] = grpc.stream_unary_rpc_method_handler(handler)
        return f"/test.Svc/{name}"

    def stream_stream(
        self, name: str, fn: Callable[[AsyncIterator[bytes], Any, int], AsyncIterator[bytes]]
    ) -> str:
        async def handler(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for item in fn(requests, context, self._record(name, context)):
                yield item

        self.handlers[name] = grpc.stream_stream_rpc_method_handler(handler)
        return f"/test.Svc/{name}"

    def count(self, name: str) -> int:
        return len(self.attempts.get(name, []))

    async def start(self, port: int = 0, *, credentials: Any = None) -> None:
        """Listen on 127.0.0.1 (``credentials``: ``grpc.ssl_server_credentials``, TLS)."""
        outer = self

        class Generic(grpc.GenericRpcHandler):  # type: ignore[misc,name-defined]
            def service(self, details: Any) -> Any:
                return outer.handlers.get(details.method.rsplit("/", 1)[-1])

        self._server = aio.server()
        self._server.add_generic_rpc_handlers((Generic(),))
        address = f"127.0.0.1:{port}"
        if credentials is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, credentials)
        if port == 0:
            forget_throttle(self.target)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)


async def abort(context: Any, code: Any, *, trailing: tuple[tuple[str, str], ...] = ()) -> None:
    if trailing:
        context.set_trailing_metadata(trailing)
    await context.abort(code, f"scripted {code.name}")


async def cancel_while_waiting_to_retry(
    server: Server, method: str, how: str, telemetry: Any = None
) -> Any:
    """A call of ``method`` (whose attempts all fail with a retryable status) is ended while
    it waits to retry, in a 16-24 s backoff (20 s, proportional jitter), by ``how``:
    ``"call.cancel()"`` or ``"channel.close()"``; it raises ``asyncio.CancelledError``. The
    channel (with ``telemetry``) is closed afterwards. Returns the call (its readers)."""
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(  # a 16-24 s backoff: the call is surely waiting in it
            server.target,
            service_config=retry_config(initial="20s", maximum="20s"),
            telemetry=telemetry,
            backoff_jitter=BackoffJitter.PROPORTIONAL,
        )
        orchestrator = retry_controller(ch).orchestrator
        call = ch.unary_unary(method)(b"x")
        pending = asyncio.ensure_future(call)
        await wait_until(lambda: orchestrator.requests_in_retry == 1)
        if how == "call.cancel()":
            assert call.cancel()
        else:
            await ch.close()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await ch.close()
    return call


def forget_throttle(target: str) -> None:
    """Drop the process's throttle bucket for ``target``, a port the OS just handed out.

    A6 keeps one bucket per target for the process: a channel an earlier test left to
    the same port (not yet collected) would share its tokens with this test's.
    """
    with _throttle._registry_lock:
        _throttle._registry.pop(server_name(target), None)


class ReservedPort:
    """A loopback port held by a bound, non-listening socket (``SO_REUSEPORT``).

    Connections to it are refused, and no other process can take it, until a
    :class:`Server` started on it (grpc servers set ``SO_REUSEPORT`` too)
    listens; then :meth:`release` lets the holder go. No bind-close-rebind race.
    """

    def __init__(self) -> None:
        import socket

        self._sock: Any = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        forget_throttle(self.target)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def release(self) -> None:
        self._sock.close()

    def __enter__(self) -> ReservedPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll state that has no event to wait on (bounded by each test's fail_after)."""
    import asyncio

    while not predicate():  # noqa: ASYNC110
        await asyncio.sleep(0.005)
