"""The call an application's interceptors made for one of sdkcore's attempts.

On a channel with application interceptors, each attempt sdkcore makes is a call of
grpc.aio's multi-callable, which runs those interceptors in a task of its own and hands
back its intercepted call (grpc.aio keeps the task as ``_interceptors_task``: a private
name, read with a fallback). sdkcore reads the attempt through the call the interceptors
returned (it awaits that task), grpc.aio's own call as a rule: the intercepted call's
accessors answer a cancellation of the task awaiting them as None or CANCELLED (an attempt
loop cancelled there read on, and a cancelled call's RPC ran on), and only grpc.aio's own
call shows its status to the channel's gate and to ``_peer_status`` (rfc/0003, "The
direct path"). An
interceptor may also return an async iterator of (transformed) responses: grpc.aio wraps
it, and its messages are read by iterating it, as grpc.aio's own intercepted call does.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:  # grpc.aio's wrapper of an interceptor's response iterator (a private class)
    from grpc.aio._interceptor import _StreamCallResponseIterator as _ResponseIterator
except ImportError:  # pragma: no cover - a grpc.aio that has it no more: nothing is one
    _ResponseIterator = ()

__all__: list[str] = []


def interceptors_task(call: Any) -> asyncio.Task[Any] | None:
    """grpc.aio's task running the application's interceptors for ``call``; None for a
    call that is not grpc.aio's intercepted call (or a grpc.aio that names it otherwise:
    the call is then read as it is, as before this module)."""
    task = getattr(call, "_interceptors_task", None)
    return task if isinstance(task, asyncio.Task) else None


def response_iterator(call: Any) -> bool:
    """Whether ``call`` is grpc.aio's wrapper of an async iterator of (transformed)
    responses an application interceptor returned: its ``read()`` raises
    NotImplementedError, its messages are what iterating it yields."""
    return isinstance(call, _ResponseIterator)


def own_call(call: Any) -> Any:
    """The grpc.aio call whose status ``call`` reports: ``call`` itself, or the call inside
    grpc.aio's wrapper of an interceptor's response iterator (its private ``_call``; an
    interceptor that never called its continuation leaves None there: the wrapper then)."""
    if isinstance(call, _ResponseIterator):
        inner = getattr(call, "_call", None)
        if inner is not None:
            return inner
    return call
