"""What the randomized schedule tests share (test_doors_fuzz, test_sync_fuzz, the memcached one),
and the hedging tests' count of live tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any

from sdkcore import RetryBudget


def expected_balance(budget: RetryBudget, deposits: int, net_withdrawn: int) -> int:
    """``RetryBudget.balance`` after these operations within one ttl (Finagle's arithmetic,
    rfc/0007 section 2: a deposit adds 1000 tokens, a withdrawal costs int(1000 / ratio),
    1 when the ratio is 0; the reserve is min_retries_per_sec * ttl * cost)."""
    ratio, minimum = budget.retry_ratio, budget.min_retries_per_sec
    if ratio == 0 and minimum == 0:
        return 0  # Finagle's Empty
    cost = int(1000 / ratio) if ratio else 1
    per_deposit = 1000 if ratio else 0
    reserve = int(minimum * budget.ttl.total_seconds() * cost)
    tokens = deposits * per_deposit - net_withdrawn * cost + reserve
    return max(0, tokens // cost)


def live_tasks() -> int:
    """Tasks alive in this event loop (asyncio) or this trio run (nothing may outlive a door)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import trio

        def count(task: Any) -> int:
            return 1 + sum(count(t) for n in task.child_nurseries for t in n.child_tasks)

        return count(trio.lowlevel.current_root_task())
    return len(asyncio.all_tasks())


def show(error: BaseException | None, width: int = 120) -> str:
    """An exception in a report: its type and the start of its message."""
    if error is None:
        return "None"
    text = str(error)
    return f"{type(error).__name__}({text[:width]}{'...' if len(text) > width else ''})"


async def leaked_tasks(
    before: Collection[asyncio.Task[Any]],
    ignore: Callable[[asyncio.Task[Any]], bool],
    settle: float = 0.3,
) -> list[asyncio.Task[Any]]:
    """Tasks of this loop not in ``before`` still pending after ``settle`` seconds (polled
    every 10 ms, returned as soon as there are none), the caller's own and those ``ignore``
    accepts left out: what grpc.aio ends in its own time after a close is not a leak."""
    loop = asyncio.get_running_loop()
    leaked: list[asyncio.Task[Any]] = []
    deadline = loop.time() + settle
    while loop.time() < deadline:
        await asyncio.sleep(0.01)
        leaked = [
            t
            for t in asyncio.all_tasks()
            if t not in before
            and not t.done()
            and t is not asyncio.current_task()
            and not ignore(t)
        ]
        if not leaked:
            break
    return leaked
