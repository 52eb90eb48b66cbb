"""Every async door of the core against a hand-written loop, ratios taken side by side.

Run:  uv run python bench/bench_doors.py [--backend asyncio|trio] [--calls N] [--rounds R]

Cases, each interleaved with its baseline in every round (median of the rounds):

* ``maybe_retry``: a hand-wired loop (``try: send`` / ``except: await
  orchestrator.maybe_retry(...)``) for a call that fails 3 times with a retryable
  error, then succeeds; baseline: ``for`` + ``try/except`` + ``anyio.sleep(0)``.
* ``execute``: the same call through ``RetryOrchestrator.execute`` (no deadline).
* ``execute+deadline``: the same with ``Request(timeout=2.5)`` (the deadline armed).
* ``happy+deadline``: one successful call through ``execute`` with the deadline
  armed, against a bare ``await send()``; printed as microseconds added.
* ``memory``: bytes held per request waiting in a backoff (``execute``, deadline
  armed) above a hand loop waiting in ``anyio.sleep``, measured with tracemalloc.

The strategy is ``BestEffortRetryStrategy(backoff=lambda n: 0.0)``, requests are
idempotent and built inside the measured loop, and structlog filters debug out,
as a production application runs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from sdkcore import (
    BestEffortRetryStrategy,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    _runtime,
)

REASON = RetryReason.KV_TEMPORARY_FAILURE


def failing(failures: int) -> Callable[[object], Awaitable[str]]:
    state = {"n": 0}

    async def send(_: object) -> str:
        if state["n"] < failures:
            state["n"] += 1
            raise RetryableError(REASON)
        state["n"] = 0
        return "ok"

    return send


async def per_call(fn: Callable[[], Awaitable[object]], calls: int) -> float:
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - start) / calls * 1e6


async def hand(send: Callable[[object], Awaitable[str]]) -> str:
    """The baseline the issue names: ``for`` + ``try/except`` + ``anyio.sleep(0)``."""
    while True:
        try:
            return await send(None)
        except RetryableError:
            await anyio.sleep(0)  # noqa: ASYNC115 - the baseline the issue names


async def hand_native(send: Callable[[object], Awaitable[str]]) -> str:
    """The same loop with the event loop's own checkpoint, the one the core uses."""
    sleep = _runtime.current().sleep
    while True:
        try:
            return await send(None)
        except RetryableError:
            await sleep(0)


def doors(orch: RetryOrchestrator) -> dict[str, Callable[[Any], Awaitable[str]]]:
    """The retried call through each async door, for a given ``send``."""

    async def wired(send: Any) -> str:
        request = Request(idempotent=True, timeout=None)
        while True:
            try:
                result: str = await send(request)
            except RetryableError as failure:
                await orch.maybe_retry(request, failure.reason, cause=failure)
                continue
            orch.succeed(request)
            return result

    async def executed(send: Any) -> str:
        return await orch.execute(Request(idempotent=True, timeout=None), send)

    async def with_deadline(send: Any) -> str:
        return await orch.execute(Request(idempotent=True, timeout=2.5), send)

    return {"maybe_retry": wired, "execute": executed, "execute+deadline": with_deadline}


async def timings(calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: 0.0))
    hand_send = failing(3)
    ok = failing(0)

    async def happy() -> str:
        return await orch.execute(Request(idempotent=True, timeout=2.5), ok)

    async def bare() -> str:
        return await ok(None)

    cases: dict[str, tuple[Callable[[], Awaitable[object]], Callable[[], Awaitable[object]]]] = {
        name: (functools.partial(door, failing(3)), functools.partial(hand, hand_send))
        for name, door in doors(orch).items()
    }
    cases["happy+deadline"] = (happy, bare)
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for fn, base in cases.values():  # warm up
        await per_call(fn, calls // 10)
        await per_call(base, calls // 10)
    for _ in range(rounds):
        for name, (fn, base) in cases.items():
            samples[name].append((await per_call(fn, calls), await per_call(base, calls)))
    return {
        name: (statistics.median(s for s, _ in pairs), statistics.median(b for _, b in pairs))
        for name, pairs in samples.items()
    }


async def memory(count: int) -> tuple[float, float]:
    """Bytes per request waiting in a backoff: (execute with a deadline, hand loop)."""
    orch = RetryOrchestrator(
        BestEffortRetryStrategy(backoff=lambda attempt: 30.0), max_requests_in_retry=10 * count
    )

    async def send(_: object) -> str:
        raise RetryableError(REASON)

    async def sdk() -> None:
        await orch.execute(Request(idempotent=True, timeout=60.0), send)

    async def hand_waiting() -> None:
        for _ in range(1000):
            try:
                await send(None)
            except RetryableError:
                await anyio.sleep(30.0)

    out: list[float] = []
    for body in (sdk, hand_waiting):
        async with anyio.create_task_group() as tg:
            for _ in range(10):  # warm the allocator and caches
                tg.start_soon(body)
            await anyio.sleep(0.05)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(count):
                tg.start_soon(body)
            await anyio.sleep(0.2)  # every one of them is in its backoff now
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            out.append((after - before) / count)
            tg.cancel_scope.cancel()
    return out[0], out[1]


async def main_async(calls: int, rounds: int) -> None:
    results = await timings(calls, rounds)
    for name, (sdk, base) in results.items():
        if name.startswith("happy"):
            added = sdk - base
            print(f"  {name:17s} sdkcore {sdk:6.2f} us  bare {base:5.2f} us  adds {added:+.2f} us")
        else:
            print(
                f"  {name:17s} sdkcore {sdk:6.2f} us  hand {base:6.2f} us  ratio {sdk / base:4.2f}x"
            )
    mem_sdk, mem_hand = await memory(2000)
    print(
        f"  {'memory':17s} sdkcore {mem_sdk:6.0f} B  hand {mem_hand:6.0f} B  "
        f"above the hand loop {mem_sdk - mem_hand:+.0f} B per request in backoff"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
    print(f"backend={args.backend} calls={args.calls} rounds={args.rounds} (medians)")
    anyio.run(main_async, args.calls, args.rounds, backend=args.backend)


if __name__ == "__main__":
    main()
