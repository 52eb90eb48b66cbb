"""Finished unary calls: a successful one reporting the client's attempt count; OK or not."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import grpc
from grpc import aio
from grpc.aio import _base_call

from ._metadata import _with_attempts

__all__: list[str] = []


def _ended_ok(call: Any) -> bool | None:
    """Whether a finished grpc.aio call ended OK (None: cannot tell without awaiting)."""
    cython_call = getattr(call, "_cython_call", None)
    if cython_call is None:
        return None
    return bool(cython_call.is_ok())


class _FinishedUnaryCall(_base_call.UnaryUnaryCall):  # type: ignore[misc]
    """A finished successful call, reporting how many attempts preceded it."""

    def __init__(self, call: Any, previous: int) -> None:
        self._call = call
        self._previous = previous

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        callback(self)

    def time_remaining(self) -> float | None:
        return None

    async def initial_metadata(self) -> Any:
        return await self._call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        return _with_attempts(await self._call.trailing_metadata(), self._previous)

    async def code(self) -> Any:
        return await self._call.code()

    async def details(self) -> str:
        return str(await self._call.details())

    async def debug_error_string(self) -> str | None:
        return await self._call.debug_error_string()  # type: ignore[no-any-return]

    async def wait_for_connection(self) -> None:
        return None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._call.__await__()  # type: ignore[no-any-return]


class _Readers:
    """The readers of a call whose outcome ``_settled()`` gives: (call, None), (None, error), or
    None when the call itself was cancelled (then as a cancelled grpc.aio unary call's: empty
    metadata, CANCELLED); ``_trailing(call, md)`` corrects the metadata."""

    async def _settled(self) -> tuple[Any, Any] | None:
        raise NotImplementedError

    def _trailing(self, call: Any, md: Any) -> Any:
        return md

    async def initial_metadata(self) -> Any:
        out = await self._settled()
        if out is None:  # cancelled: empty, as a grpc.aio unary call's
            return aio.Metadata()
        call, err = out
        return err.initial_metadata() if err is not None else await call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        out = await self._settled()
        if out is None:  # cancelled: empty, as a grpc.aio unary call's
            return aio.Metadata()
        call, err = out
        if err is not None:
            return err.trailing_metadata()
        return self._trailing(call, await call.trailing_metadata())

    async def code(self) -> Any:
        out = await self._settled()
        if out is None:
            return grpc.StatusCode.CANCELLED
        call, err = out
        return err.code() if err is not None else await call.code()

    async def details(self) -> str:
        out = await self._settled()
        if out is None:
            return "Locally cancelled by application!"
        call, err = out
        return str(err.details() if err is not None else await call.details())

    async def debug_error_string(self) -> str | None:
        out = await self._settled()
        if out is None:
            return ""
        call, err = out
        if err is not None:
            return err.debug_error_string()  # type: ignore[no-any-return]
        return await call.debug_error_string()  # type: ignore[no-any-return]
