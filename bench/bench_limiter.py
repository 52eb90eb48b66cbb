"""What a concurrency limiter adds to a successful call (rfc/0009).

Run:  uv run python bench/bench_limiter.py [--calls N] [--rounds R]

Each variant is the same function around the bare call: ``with limiter.guard():`` for
a fixed :class:`ConcurrencyLimiter` and for an :class:`AdaptiveConcurrencyLimiter`
(which reads the clock twice and feeds its window), the circuit breaker's guard for
comparison, and the three stacked in the documented order. The async variants do the
same through ``async with limiter.acquire():`` on asyncio, against a bare ``await``.
All run in one process, interleaved round by round; the figure is the median over
rounds of (variant - bare) per call. Targets (issue 23): fixed guard <= 0.5 us,
adaptive <= 1 us.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from sdkcore import CircuitBreaker
from sdkcore._adaptive_limiter import AdaptiveConcurrencyLimiter
from sdkcore._limiter import ConcurrencyLimiter


def bare_call() -> str:
    return "ok"


def sync_variants() -> dict[str, Callable[[], str]]:
    fixed = ConcurrencyLimiter(64, name="bench:11210")
    adaptive = AdaptiveConcurrencyLimiter(name="bench:11210")
    breaker = CircuitBreaker(name="bench:11210")
    fixed_guard, adaptive_guard, breaker_guard = fixed.guard, adaptive.guard, breaker.guard

    def bare() -> str:
        return bare_call()

    def fixed_limiter() -> str:
        with fixed_guard():
            return bare_call()

    def adaptive_limiter() -> str:
        with adaptive_guard():
            return bare_call()

    def breaker_only() -> str:
        with breaker_guard():
            return bare_call()

    def adaptive_then_breaker() -> str:  # limiter -> breaker -> send
        with adaptive_guard(), breaker_guard():
            return bare_call()

    return {
        "bare": bare,
        "ConcurrencyLimiter.guard()": fixed_limiter,
        "AdaptiveConcurrencyLimiter.guard()": adaptive_limiter,
        "CircuitBreaker.guard() (reference)": breaker_only,
        "adaptive + breaker": adaptive_then_breaker,
    }


def async_variants() -> dict[str, Callable[[], Awaitable[str]]]:
    fixed = ConcurrencyLimiter(64, max_queued=64)
    adaptive = AdaptiveConcurrencyLimiter(max_queued=64)

    async def answer() -> str:
        return "ok"

    async def bare() -> str:
        return await answer()

    async def fixed_acquire() -> str:
        async with fixed.acquire():
            return await answer()

    async def adaptive_acquire() -> str:
        async with adaptive.acquire():
            return await answer()

    return {
        "bare await": bare,
        "ConcurrencyLimiter.acquire()": fixed_acquire,
        "AdaptiveConcurrencyLimiter.acquire()": adaptive_acquire,
    }


def per_call_us(fn: Callable[[], str], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


async def per_call_async_us(fn: Callable[[], Awaitable[str]], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(
    names: list[str], timed: Callable[[str], float], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    samples: dict[str, list[float]] = {name: [] for name in names}
    overhead: dict[str, list[float]] = {name: [] for name in names[1:]}
    for _ in range(rounds):
        bare = timed(names[0])
        samples[names[0]].append(bare)
        for name in names[1:]:
            us = timed(name)
            samples[name].append(us)
            overhead[name].append(us - bare)
    return samples, overhead


def report(samples: dict[str, list[float]], overhead: dict[str, list[float]]) -> None:
    first = next(iter(samples))
    print(f"{'variant':<38} {'median us/call':>15} {'overhead us (median)':>22}")
    print(f"{first:<38} {statistics.median(samples[first]):>15.3f}")
    for name, values in overhead.items():
        median = statistics.median(values)
        print(f"{name:<38} {statistics.median(samples[name]):>15.3f} {median:>22.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    sync = sync_variants()
    coros = async_variants()
    loop = asyncio.new_event_loop()
    gc.disable()
    try:
        sync_result = measure(
            list(sync), lambda name: per_call_us(sync[name], args.calls), args.rounds
        )
        async_result = measure(
            list(coros),
            lambda name: loop.run_until_complete(per_call_async_us(coros[name], args.calls)),
            args.rounds,
        )
    finally:
        gc.enable()
        loop.close()
    print(f"python {sys.version.split()[0]}, {args.calls} calls x {args.rounds} rounds")
    report(*sync_result)
    print()
    report(*async_result)


if __name__ == "__main__":
    main()
