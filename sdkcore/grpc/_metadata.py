"""Metadata helpers of the gRPC channels: the A6 previous-attempts header, message sizes.

No sdkcore state lives here; every other module of the package may import it.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from grpc import aio

from .._untrusted import show

__all__ = [
    "DEFAULT_CHANNEL_BUFFER_LIMIT",
    "DEFAULT_PER_CALL_BUFFER_LIMIT",
    "PREVIOUS_ATTEMPTS_KEY",
    "default_message_size",
    "previous_rpc_attempts",
]

#: A6 "Exposed Retry Metadata" header.
PREVIOUS_ATTEMPTS_KEY = "grpc-previous-rpc-attempts"
#: Per-call replay buffer limit (A6 ``per_rpc_buffer_limit_in_bytes``).
DEFAULT_PER_CALL_BUFFER_LIMIT = 256 * 1024
#: Per-channel replay buffer limit (A6 ``retry_buffer_size_in_bytes``).
DEFAULT_CHANNEL_BUFFER_LIMIT = 16 * 1024 * 1024


def default_message_size(message: Any) -> int:
    """Bytes a request message takes in the replay buffer.

    ``len`` for bytes-like values, ``ByteSize()`` for protobuf messages, else
    ``sys.getsizeof`` (pass ``message_size=`` for anything more precise).
    """
    if isinstance(message, (bytes, bytearray)):
        return len(message)
    if isinstance(message, memoryview):
        return message.nbytes
    byte_size = getattr(message, "ByteSize", None)
    if callable(byte_size):
        return int(byte_size())
    return sys.getsizeof(message)


def _bad_metadata(value: object) -> TypeError:
    return TypeError(
        "previous_rpc_attempts(error_or_metadata) must be the grpc.aio.AioRpcError a call "
        "raised or a call's trailing metadata ((key, value) pairs), got "
        f"{show(value)} ({type(value).__name__})"
    )


def previous_rpc_attempts(error_or_metadata: Any) -> int:
    """How many attempts preceded the final one (0 when the first attempt decided).

    A plain function. Pass the ``AioRpcError`` a call raised, or the trailing
    metadata of a finished call: ``previous_rpc_attempts(await
    call.trailing_metadata())`` (grpc.aio makes a call's metadata awaitable; the
    count in it is not). A call object itself raises TypeError saying so, and so does
    anything that is neither (not ``(key, value)`` pairs), naming ``error_or_metadata``.

    The count is the client's own on a call that sdkcore retries (a method with a
    retryPolicy or hedgingPolicy, throttling, a limiter, telemetry, or a call that
    started without a connection and may be re-sent transparently): sdkcore replaces
    any ``grpc-previous-rpc-attempts`` the server put in its trailing metadata, and
    sets it only when retries happened. A call that can never be retried (no policy,
    started on a READY channel: grpc.aio's own call, rfc/0003 "The direct path")
    returns what the server sent, as on a plain grpc.aio channel. A value that is not
    a non-negative integer of at most 10 digits counts as 0.
    """
    md = error_or_metadata
    trailing = getattr(md, "trailing_metadata", None)
    if trailing is not None:
        if inspect.iscoroutinefunction(trailing):
            raise TypeError(
                "previous_rpc_attempts(call): a call's trailing metadata must be awaited; "
                "pass `await call.trailing_metadata()` (or the AioRpcError the call raised)"
            )
        md = trailing()
    if not md:
        if md is None or hasattr(md, "__iter__"):  # no trailing metadata
            return 0
        raise _bad_metadata(error_or_metadata)
    value: Any = None
    try:
        for key, v in md:
            if key == PREVIOUS_ATTEMPTS_KEY:
                value = v
    except (TypeError, ValueError):  # not (key, value) pairs
        raise _bad_metadata(error_or_metadata) from None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 10:
        return 0
    return int(value)


def _truthy(value: Any) -> bool:
    """A grpc integer channel argument as a switch."""
    if isinstance(value, str):
        return value.strip() not in ("", "0")
    return bool(value)


def _with_attempts(md: Any, previous: int) -> aio.Metadata:
    """``md`` without any ``grpc-previous-rpc-attempts``, plus sdkcore's count if > 0."""
    out = aio.Metadata(*[(k, v) for k, v in (md or ()) if k != PREVIOUS_ATTEMPTS_KEY])
    if previous > 0:
        out.add(PREVIOUS_ATTEMPTS_KEY, str(previous))
    return out


def _client_trailing(md: Any, previous: int) -> Any:
    """Trailing metadata for the application: the previous-attempts count is the client's."""
    if previous > 0 or (md and any(k == PREVIOUS_ATTEMPTS_KEY for k, _ in md)):
        return _with_attempts(md, previous)
    return md


def _strip_attempts(md: Any) -> Any:
    """``md`` without a ``grpc-previous-rpc-attempts`` the application put in it."""
    if md and any(k == PREVIOUS_ATTEMPTS_KEY for k, _ in md):
        return aio.Metadata(*[(k, v) for k, v in md if k != PREVIOUS_ATTEMPTS_KEY])
    return md
