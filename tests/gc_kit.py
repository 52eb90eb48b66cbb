"""What calls leave to the garbage collector: sdkcore's objects in reference cycles.

Shared by tests/test_no_cycles.py (the core's doors) and
tests/grpc_a6/test_grpc_no_cycles.py (every gRPC call shape).
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable


async def sdkcore_garbage(call: Callable[[int], Awaitable[object]], calls: int) -> list[str]:
    """The type names of sdkcore's objects that ``call(0)`` .. ``call(calls - 1)`` left in
    reference cycles (found by one collection with the collector's saved garbage)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
    try:
        for i in range(calls):
            await call(i)
        gc.collect()
        return [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("sdkcore")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
