"""What a circuit breaker and a retry budget add to a successful call.

Run:  uv run python bench/bench_protect.py [--calls N] [--rounds R]

A successful call with protection is: ``breaker.try_acquire()``, ``budget.deposit()``
(the first attempt's deposit), the call, ``breaker.record_success()``; and the same
through ``with breaker.guard():``, the one line the docs give SDK maintainers. The bare call
is the same function without them. Both run in the same process, interleaved
round by round; the figure is the median over rounds of (protected - bare) per
call. Each piece is also measured alone against the bare call. Target (issue
"Endpoints that protect themselves"): breaker and budget together <= 0.5 us.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator

from sdkcore import CircuitBreaker, RetryBudget


def bare_call() -> str:
    return "ok"


def make_variants() -> dict[str, Callable[[], str]]:
    breaker = CircuitBreaker(name="bench:11210")
    budget = RetryBudget()
    try_acquire = breaker.try_acquire
    record_success = breaker.record_success
    deposit = budget.deposit

    def bare() -> str:
        return bare_call()

    def both() -> str:
        if not try_acquire():
            raise RuntimeError("refused")
        deposit()
        result = bare_call()
        record_success()
        return result

    def breaker_only() -> str:
        if not try_acquire():
            raise RuntimeError("refused")
        result = bare_call()
        record_success()
        return result

    def budget_only() -> str:
        deposit()
        return bare_call()

    guard = breaker.guard

    def guarded() -> str:  # the documented one line, as a send writes it
        deposit()
        with guard():
            return bare_call()

    @contextlib.contextmanager
    def generator_guard() -> Iterator[None]:  # what guard() would cost as a generator
        if not try_acquire():
            raise RuntimeError("refused")
        try:
            yield
        except Exception as exc:
            breaker.record_failure(exc)
            raise
        record_success()

    def generator_guarded() -> str:
        deposit()
        with generator_guard():
            return bare_call()

    return {
        "bare": bare,
        "breaker+budget": both,
        "breaker": breaker_only,
        "budget": budget_only,
        "guard()+budget": guarded,
        "contextmanager+budget": generator_guarded,
    }


def per_call_us(fn: Callable[[], str], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    variants = make_variants()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    overhead: dict[str, list[float]] = {name: [] for name in variants if name != "bare"}
    gc.disable()
    try:
        for _ in range(args.rounds):
            bare = per_call_us(variants["bare"], args.calls)
            samples["bare"].append(bare)
            for name in overhead:
                us = per_call_us(variants[name], args.calls)
                samples[name].append(us)
                overhead[name].append(us - bare)
    finally:
        gc.enable()
    print(f"python {sys.version.split()[0]}, {args.calls} calls x {args.rounds} rounds")
    print(f"{'variant':<16} {'median us/call':>15} {'overhead us (median)':>22}")
    print(f"{'bare':<16} {statistics.median(samples['bare']):>15.3f} {'':>22}")
    for name, values in overhead.items():
        median = statistics.median(values)
        print(f"{name:<16} {statistics.median(samples[name]):>15.3f} {median:>22.3f}")


if __name__ == "__main__":
    main()
