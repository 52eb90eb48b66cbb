"""What arming and disarming one deadline costs, per event loop, side by side.

Run:  uv run python bench/bench_runtime.py [--calls N] [--rounds R]

Each variant arms a deadline 2.5 s ahead and disarms it at once (what a successful
call with a deadline pays), in one process, interleaved round by round; the median
of the rounds is printed, in microseconds per arm + disarm:

* asyncio: sdkcore's ``Scope`` (one shared heap and loop timer per loop, the task's
  own cancellation), the same ``Scope`` without a deadline (its object and task
  lookup alone), a loop timer per call (``loop.call_at`` + ``cancel``, what the
  shared heap replaces), and an anyio cancel scope;
* trio: sdkcore's ``Scope`` (a ``trio.CancelScope``), a bare ``trio.CancelScope``,
  and an anyio cancel scope;
* on each loop, one zero-delay wait (a checkpoint): the loop's ``sleep(0)`` against
  ``anyio.sleep(0)``, in microseconds per wait.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import trio

from sdkcore._runtime import _asyncio as asyncio_backend
from sdkcore._runtime import _trio as trio_backend


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def medians(variants: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        per_call_us(fn, calls // 10)  # warm up
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(per_call_us(fn, calls))
    return {name: statistics.median(values) for name, values in samples.items()}


async def awaited_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - start) / calls * 1e6


async def checkpoints(native: Callable[[], Any], calls: int, rounds: int) -> dict[str, float]:
    """One zero-delay wait: the loop's own ``sleep(0)`` against ``anyio.sleep(0)``."""
    variants = {
        "checkpoint: the loop's sleep(0)": native,
        "checkpoint: anyio.sleep(0)": anyio.sleep,
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(await awaited_us(lambda fn=fn: fn(0), calls))
    return {name: statistics.median(values) for name, values in samples.items()}


async def on_asyncio(calls: int, rounds: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()

    def sdkcore_scope() -> None:
        asyncio_backend.Scope(loop.time() + 2.5).exit(None)

    def sdkcore_scope_no_deadline() -> None:  # the object and the task lookup alone
        asyncio_backend.Scope(math.inf).exit(None)

    def loop_timer() -> None:
        loop.call_at(loop.time() + 2.5, print).cancel()

    def anyio_scope() -> None:
        with anyio.CancelScope(deadline=loop.time() + 2.5):  # noqa: ASYNC100 - arm + disarm
            pass

    variants: dict[str, Callable[[], object]] = {
        "sdkcore Scope (shared heap)": sdkcore_scope,
        "sdkcore Scope, no deadline": sdkcore_scope_no_deadline,
        "loop.call_at + cancel": loop_timer,
        "anyio CancelScope": anyio_scope,
    }
    return medians(variants, calls, rounds) | await checkpoints(asyncio.sleep, calls, rounds)


async def on_trio(calls: int, rounds: int) -> dict[str, float]:
    def sdkcore_scope() -> None:
        trio_backend.Scope(trio.current_time() + 2.5).exit(None)

    def trio_scope() -> None:
        with trio.CancelScope(deadline=trio.current_time() + 2.5):  # noqa: ASYNC100
            pass

    def anyio_scope() -> None:
        with anyio.CancelScope(deadline=trio.current_time() + 2.5):  # noqa: ASYNC100
            pass

    return medians(
        {
            "sdkcore Scope (trio.CancelScope)": sdkcore_scope,
            "trio.CancelScope": trio_scope,
            "anyio CancelScope": anyio_scope,
        },
        calls,
        rounds,
    ) | await checkpoints(trio.sleep, calls, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {args.calls} calls x {args.rounds} rounds (medians)")
    for title, results in (
        ("asyncio", asyncio.run(on_asyncio(args.calls, args.rounds))),
        ("trio", trio.run(on_trio, args.calls, args.rounds)),
    ):
        print(title)
        for name, us in results.items():
            unit = "per wait" if name.startswith("checkpoint") else "per arm + disarm"
            print(f"  {name:36s} {us:6.2f} us {unit}")


if __name__ == "__main__":
    main()
