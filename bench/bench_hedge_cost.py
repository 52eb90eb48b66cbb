"""What hedging costs a request that needs no hedge, on asyncio and trio.

``RetryOrchestrator.hedge`` (2 attempts, 20 ms delay) against a bare call of the same
``send``, when the first attempt answers well within the delay (the 98% case of
bench_hedge.py). Two figures:

* time per call, one call at a time, for a ``send`` that yields once (``sleep(0)``):
  the runner's own cost;
* p50 / p90 latency at 20 concurrent callers for a ``send`` that sleeps 1-3 ms: what
  the runner adds to a request under load (extra event-loop iterations show here).

    uv run python bench/bench_hedge_cost.py
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
from bench_hedge import drive, pct  # the closed-loop driver of bench_hedge.py

from sdkcore import HedgePolicy, Request, RetryOrchestrator

POLICY = HedgePolicy(2, delay=0.02)
CALLS = 20_000
CONCURRENT = 20
LOADED_CALLS = 10_000


async def per_call(call: Callable[[], Awaitable[Any]]) -> float:
    for _ in range(500):
        await call()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        await call()
    return (time.perf_counter() - t0) / CALLS * 1e6


async def loaded(call: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    latencies = await drive(call, LOADED_CALLS, CONCURRENT)
    return pct(latencies, 50) * 1000, pct(latencies, 90) * 1000


async def main() -> None:
    orchestrator = RetryOrchestrator()
    rng = random.Random(1)

    async def yields(request: Request, index: int = 0) -> int:
        await anyio.lowlevel.checkpoint()
        return 1

    async def sleeps(request: Request, index: int = 0) -> int:
        await anyio.sleep(rng.uniform(0.001, 0.003))
        return 1

    def request() -> Request:
        return Request(name="get", idempotent=True, timeout=5.0)

    async def bare_yield() -> int:
        return await yields(request())

    async def hedged_yield() -> int:
        return await orchestrator.hedge(request(), yields, POLICY)

    async def bare_sleep() -> int:
        return await sleeps(request())

    async def hedged_sleep() -> int:
        return await orchestrator.hedge(request(), sleeps, POLICY)

    for _ in range(2):  # twice: the second pass shows the spread
        a, b = await per_call(bare_yield), await per_call(hedged_yield)
        (c50, c90), (d50, d90) = await loaded(bare_sleep), await loaded(hedged_sleep)
        print(
            f"  per call: send {a:5.1f} µs, hedge {b:5.1f} µs (+{b - a:.1f})   "
            f"{CONCURRENT} callers, 1-3 ms send: p50 {c50:.2f} -> {d50:.2f} ms "
            f"({d50 / c50:.3f}x), p90 {c90:.2f} -> {d90:.2f} ms"
        )


if __name__ == "__main__":
    for backend in ("asyncio", "trio"):
        print(backend)
        anyio.run(main, backend=backend)
