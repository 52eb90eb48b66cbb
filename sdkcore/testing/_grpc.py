"""A scripted grpc.aio server on 127.0.0.1 for tests (needs grpcio; asyncio only)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

import anyio
import attrs
import grpc
from grpc import aio

from .._untrusted import show as _show
from ..mapping import GrpcCode, grpc_code
from . import Delay

__all__ = ["GrpcStatus", "ScriptedGrpcServer", "grpc_server"]


def _check_code(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if grpc_code(value) is GrpcCode.OK:
        raise ValueError("GrpcStatus(code): OK is not a failure; script the reply bytes instead")


#: grpc-retry-pushback-ms is an int32 on the wire.
_PUSHBACK_RANGE = (-(2**31), 2**31 - 1)


def _check_pushback(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"GrpcStatus(pushback_ms) must be an int (-1: do not retry) or None, got {_show(value)}"
        )
    if not _PUSHBACK_RANGE[0] <= value <= _PUSHBACK_RANGE[1]:
        raise ValueError(
            "GrpcStatus(pushback_ms) must fit the int32 grpc-retry-pushback-ms trailer "
            f"(-2**31..2**31-1), got {_show(value)}"
        )


def _check_message(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"GrpcStatus(message) must be a str, got {_show(value)}")


#: What gRPC takes as a metadata key: lowercase letters, digits, ``-``, ``_`` and ``.``.
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


def _check_trailing(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """(key, value) pairs as gRPC sends them, checked here: a bad one made the server's
    abort fail (the client saw UNKNOWN or INTERNAL), and a ``-bin`` key with a str value
    left the call hanging until its deadline."""
    where = "GrpcStatus(trailing)"
    if not isinstance(value, tuple):
        raise TypeError(f"{where} must be a tuple of (key, value) pairs, got {_show(value)}")
    for pair in value:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(
                f"{where} must be a tuple of (key, value) pairs, got the item {_show(pair)}; "
                'e.g. trailing=(("x-reason", "busy"),)'
            )
        key, item = pair
        if not isinstance(key, str) or not key or not set(key) <= _KEY_CHARS:
            raise ValueError(
                f"{where}: the key {_show(key)} is not a gRPC metadata key (lowercase letters, "
                "digits, '-', '_' and '.')"
            )
        if key.endswith("-bin"):
            if not isinstance(item, bytes):
                raise TypeError(
                    f"{where}: the binary key {key!r} needs a bytes value, got {_show(item)}"
                )
        elif not (isinstance(item, (str, bytes)) and item.isascii() and _printable(item)):
            raise TypeError(
                f"{where}: the key {key!r} needs a printable ASCII value (a '-bin' key "
                f"takes any bytes), got {_show(item)}"
            )


def _printable(value: str | bytes) -> bool:
    text = value.decode("ascii") if isinstance(value, bytes) else value
    return text.isprintable()


def _pairs(value: object) -> object:
    """A list of pairs (or of two-item lists), as grpc takes them: a tuple of tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(tuple(p) if isinstance(p, list) else p for p in value)
    return value


@attrs.frozen(slots=True)
class GrpcStatus:
    """A script step for :func:`grpc_server`: fail the attempt with ``code``.

    ``code`` is a :class:`~sdkcore.mapping.GrpcCode`, a ``grpc.StatusCode``, an int or
    a name. ``pushback_ms`` sends the A6 ``grpc-retry-pushback-ms`` trailer (a
    negative value asks the client not to retry); ``trailing`` adds more trailers.
    """

    code: GrpcCode = attrs.field(converter=grpc_code, validator=_check_code)
    message: str = attrs.field(default="", validator=_check_message)
    pushback_ms: int | None = attrs.field(default=None, validator=_check_pushback)
    trailing: tuple[tuple[str, str | bytes], ...] = attrs.field(
        default=(), converter=_pairs, validator=_check_trailing
    )


def _step(step: object, where: str) -> object:
    """Validate a server step; bare codes become GrpcStatus."""
    if isinstance(step, Delay):
        return Delay(step.seconds, _step(step.then, where))
    if isinstance(step, (bytes, GrpcStatus)):
        return step
    if isinstance(step, (GrpcCode, grpc.StatusCode)):
        return GrpcStatus(step)
    raise TypeError(
        f"{where}: a grpc_server step is reply bytes, a GrpcCode / grpc.StatusCode, a "
        f"GrpcStatus or a Delay, got {_show(step)}"
    )


class ScriptedGrpcServer:
    """A running :func:`grpc_server`: where it listens and what it received.

    ``calls`` is the number of attempts received, ``calls_by_method`` the same per
    full method name, ``metadata`` the invocation metadata of each attempt (text
    keys only, e.g. ``grpc-previous-rpc-attempts``) and ``requests`` its payload.
    """

    def __init__(self, scripts: dict[str | None, list[object]]) -> None:
        self._scripts = scripts
        self._positions: dict[str | None, int] = dict.fromkeys(scripts, 0)
        self.port = 0
        self.calls = 0
        self.calls_by_method: dict[str, int] = {}
        self.metadata: list[dict[str, str]] = []
        self.requests: list[bytes] = []

    @property
    def target(self) -> str:
        """``"127.0.0.1:<port>"``: give it to ``sdkcore.grpc.insecure_channel``."""
        return f"127.0.0.1:{self.port}"

    def _next(self, method: str) -> object:
        key: str | None = method if method in self._scripts else None
        steps = self._scripts.get(key)
        if steps is None:
            return GrpcStatus(GrpcCode.UNIMPLEMENTED, f"no script for {method}")
        position = self._positions[key]
        self._positions[key] = position + 1
        return steps[min(position, len(steps) - 1)]

    async def _handle(self, method: str, request: bytes, context: Any) -> bytes:
        self.calls += 1
        self.calls_by_method[method] = self.calls_by_method.get(method, 0) + 1
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        self.requests.append(request)
        step = self._next(method)
        while isinstance(step, Delay):
            await anyio.sleep(step.seconds)
            step = step.then
        if isinstance(step, GrpcStatus):
            trailing = list(step.trailing)
            if step.pushback_ms is not None:
                trailing.append(("grpc-retry-pushback-ms", str(step.pushback_ms)))
            if trailing:
                context.set_trailing_metadata(tuple(trailing))
            message = step.message or f"scripted {step.code.name}"
            await context.abort(getattr(grpc.StatusCode, step.code.name), message)
        assert isinstance(step, bytes)
        return step


def grpc_server(
    script: Iterable[object] | Mapping[str, Iterable[object]],
) -> contextlib.AbstractAsyncContextManager[ScriptedGrpcServer]:
    """Run a grpc.aio server on 127.0.0.1 (a free port) that plays ``script``.

    Every unary-unary method (bytes in, bytes out) is served; each attempt takes the
    next step, and the last step repeats:

    * ``bytes``: the reply;
    * a :class:`~sdkcore.mapping.GrpcCode` or ``grpc.StatusCode``: fail with that status;
    * a :class:`GrpcStatus`: fail with a message, pushback or trailers;
    * a :class:`~sdkcore.testing.Delay`: wait (a slow server), then play its ``then``.

    ``script`` may be a mapping from full method name (``"/pkg.Svc/Get"``) to its own
    script; methods not named there answer UNIMPLEMENTED. Needs grpcio and asyncio
    (grpc.aio); the server stops when the ``async with`` ends. A bad script raises
    here, before anything starts::

        async with grpc_server([GrpcCode.UNAVAILABLE, b"ok"]) as server:
            async with sdkcore.grpc.insecure_channel(server.target, ...) as channel:
                ...
    """
    scripts: dict[str | None, list[object]] = {}
    if isinstance(script, Mapping):
        for method, steps in script.items():
            if not isinstance(method, str) or not method.startswith("/"):
                raise TypeError(
                    "grpc_server({method: script}): keys are full method names such as "
                    f'"/pkg.Svc/Get", got {_show(method)}'
                )
            if isinstance(steps, (bytes, str)) or not isinstance(steps, Iterable):
                raise TypeError(
                    f"grpc_server({{{method!r}: script}}): each method's script is a list of "
                    f"steps, got {_show(steps)} ({type(steps).__name__}); wrap it: [{_show(steps)}]"
                )
            scripts[method] = [_step(s, f"grpc_server[{_show(method)}]") for s in steps]
    elif isinstance(script, (bytes, str)) or not isinstance(script, Iterable):
        raise TypeError(
            f"grpc_server(script) takes a list of steps, got {_show(script)} "
            f"({type(script).__name__}); wrap it: [{_show(script)}]"
        )
    else:
        scripts[None] = [_step(s, "grpc_server(script)") for s in script]
    for key, steps in scripts.items():
        if not steps:
            where = "grpc_server(script)" if key is None else f"grpc_server[{_show(key)}]"
            raise ValueError(f"{where} needs at least one step")
    return _serve(ScriptedGrpcServer(scripts))


@contextlib.asynccontextmanager
async def _serve(state: ScriptedGrpcServer) -> AsyncGenerator[ScriptedGrpcServer, None]:
    def unary(method: str) -> Any:
        async def handler(request: bytes, context: Any) -> bytes:
            return await state._handle(method, request, context)

        return grpc.unary_unary_rpc_method_handler(handler)

    class Handlers(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: Any) -> Any:
            return unary(str(details.method))

    server = aio.server()
    server.add_generic_rpc_handlers((Handlers(),))
    state.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield state
    finally:
        await server.stop(None)
