"""What a subprocess's stderr may hold besides sdkcore's own output."""

from __future__ import annotations

import re

#: grpc.aio's server, stopped with RPCs of cancelled copies still pending, sometimes
#: prints the cancellation of its own per-RPC task (seen once in four runs of the demo on
#: a loaded machine, in a review): grpc's text, from grpc's frames only, not sdkcore's.
_GRPC_SERVER_CANCEL = re.compile(
    r"Traceback \(most recent call last\):\n"
    r"(?:  File \"src/python/grpcio/grpc/_cython/[^\n]*\n(?:    [^\n]*\n)?)+"
    r"asyncio\.exceptions\.CancelledError\n"
)


def tracebacks(stderr: str | bytes) -> bool:
    """Whether ``stderr`` holds a traceback other than grpc's server cancellation noise."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    return "Traceback" in _GRPC_SERVER_CANCEL.sub("", text)
