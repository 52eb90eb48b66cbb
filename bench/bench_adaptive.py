"""What the adaptive throttle and the learned hedging delay add per request.

Run:  uv run python bench/bench_adaptive.py [--calls N] [--rounds R] [--hedged N]
      uv run python bench/bench_adaptive.py --instructions   # valgrind's counts

Throttle: a successful call through ``with throttle.guard():`` (and through
``admit()`` + ``record_success()``) against the bare call, while nothing is rejected
(the common case) and while the backend rejects two requests in three (the
throttle is shedding; the random source admits every request so each call is
measured alike). Hedging: the bookkeeping a hedged request does for its delay, with
a fixed ``timedelta`` and with a ``LatencyQuantile`` (read the delay, record the
copy's latency), and whole ``RetryOrchestrator.hedge`` calls answered at once with
either policy, side by side on asyncio. Every variant runs in the same process,
interleaved round by round; the figure is the median over rounds of (variant - bare)
per call. Targets (issue "Shed load before it breaks"): throttle <= 1 us, adaptive
hedge delay bookkeeping <= 1 us per request.

``--instructions`` counts what each case executes instead (``valgrind --tool=callgrind``,
``N`` and ``3N`` calls in fresh interpreters, the difference over ``2N``; the method of
bench_instructions.py): the same figure whatever else the shared machine does. The
breaker's ``guard()`` with a budget deposit (0.47 us in bench_protect.py) is counted
too, as the yardstick from instructions to time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    CircuitBreaker,
    ConcurrencyLimiter,
    HedgePolicy,
    Request,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore._latency import LatencyQuantile
from sdkcore._throttle import AdaptiveThrottle

BUSY = RetryableError(RetryReason.KV_TEMPORARY_FAILURE)


def bare_call() -> str:
    return "ok"


def throttle_variants() -> dict[str, Callable[[], str]]:
    calm = AdaptiveThrottle(name="bench:11210")
    guard = calm.guard
    admit = calm.admit
    record_success = calm.record_success

    # Shedding: 2 rejections per accept in the window (p = (3 - 2) / 4 > 0), so every
    # admission takes the locked path; random() = 1.0 admits every request anyway.
    shedding = AdaptiveThrottle(name="bench:11211", random=lambda: 1.0)
    for _ in range(1000):
        shedding.record_success()
        shedding.record_failure(BUSY)
        shedding.record_failure(BUSY)
    assert shedding.rejection_probability > 0.0
    shed_guard = shedding.guard

    def bare() -> str:
        return bare_call()

    def guarded() -> str:
        with guard():
            return bare_call()

    def split() -> str:
        if not admit():
            raise RuntimeError("refused")
        result = bare_call()
        record_success()
        return result

    def guarded_shedding() -> str:
        with shed_guard():
            return bare_call()

    return {
        "bare": bare,
        "throttle guard()": guarded,
        "admit+record_success": split,
        "guard() while shedding": guarded_shedding,
    }


def hedge_bookkeeping_variants() -> dict[str, Callable[[], str]]:
    """What ``_Chain`` does for its delay per request, and nothing else.

    Fixed: ``policy.delay.total_seconds()`` and ``policy.latency`` (None). Learned: the
    same reads (a clock read and a comparison in ``LatencyQuantile.delay_seconds``), a
    clock read for the copy's latency, and ``LatencyQuantile.record``.
    """
    fixed = HedgePolicy(2, delay=timedelta(milliseconds=10))
    quantile = LatencyQuantile()
    learned = HedgePolicy(2, delay=quantile)
    for i in range(200):
        quantile.record(0.001 + i * 1e-5)
    clock = time.monotonic

    def bare() -> str:
        return bare_call()

    def with_fixed() -> str:
        due = started + fixed.delay.total_seconds()  # the chain's next_at
        latency = fixed.latency
        result = bare_call()
        if latency is not None:
            latency.record(clock() - started)
        return result if due > 0.0 else ""

    started = clock() - 0.001  # the chain has the copy's start already (attempt.started)

    def with_learned() -> str:
        due = started + learned.delay.total_seconds()  # the chain's next_at
        latency = learned.latency
        result = bare_call()
        if latency is not None:
            latency.record(clock() - started)
        return result if due > 0.0 else ""

    return {"bare": bare, "fixed delay": with_fixed, "LatencyQuantile": with_learned}


def per_call_us(fn: Callable[[], str], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(variants: dict[str, Callable[[], str]], calls: int, rounds: int) -> None:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    overhead: dict[str, list[float]] = {name: [] for name in variants if name != "bare"}
    gc.disable()
    try:
        for _ in range(rounds):
            bare = per_call_us(variants["bare"], calls)
            samples["bare"].append(bare)
            for name in overhead:
                us = per_call_us(variants[name], calls)
                samples[name].append(us)
                overhead[name].append(us - bare)
    finally:
        gc.enable()
    print(f"{'variant':<24} {'median us/call':>15} {'overhead us (median)':>22}")
    print(f"{'bare':<24} {statistics.median(samples['bare']):>15.3f} {'':>22}")
    for name, values in overhead.items():
        median = statistics.median(values)
        print(f"{name:<24} {statistics.median(samples[name]):>15.3f} {median:>22.3f}")


async def hedged_rounds(calls: int, rounds: int) -> None:
    """Whole hedged requests answered at once: a fixed delay against a learned one."""
    quantile = LatencyQuantile(min_samples=1)
    policies = {
        "fixed delay": HedgePolicy(2, delay=timedelta(milliseconds=10)),
        "LatencyQuantile": HedgePolicy(2, delay=quantile),
    }
    orchestrator = RetryOrchestrator()

    async def send(request: Request, index: int) -> str:
        return "ok"

    async def run(policy: HedgePolicy) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            await orchestrator.hedge(Request(name="get", idempotent=True), send, policy)
        return (time.perf_counter() - start) / calls * 1e6

    for policy in policies.values():  # warm up (and give the quantile its delay)
        await run(policy)
    samples: dict[str, list[float]] = {name: [] for name in policies}
    diffs: list[float] = []
    gc.disable()
    try:
        for i in range(rounds):  # ABBA: a drift of the machine cancels out of the pairs
            if i % 2:
                learned = await run(policies["LatencyQuantile"])
                fixed = await run(policies["fixed delay"])
            else:
                fixed = await run(policies["fixed delay"])
                learned = await run(policies["LatencyQuantile"])
            samples["fixed delay"].append(fixed)
            samples["LatencyQuantile"].append(learned)
            diffs.append(learned - fixed)
    finally:
        gc.enable()
    print(f"{'hedge() answered at once':<24} {'median us/call':>15}")
    for name, values in samples.items():
        print(f"{name:<24} {statistics.median(values):>15.3f}")
    print(f"{'learned - fixed':<24} {statistics.median(diffs):>15.3f}")


CASES = (
    "bare",
    "breaker guard()+budget",
    "throttle guard()",
    "limiter guard()",
    "adaptive limiter guard()",
    "fixed delay",
    "LatencyQuantile",
)
HEDGE_CASES = ("hedge() fixed delay", "hedge() LatencyQuantile")


def run_case(case: str, calls: int) -> None:
    """``calls`` calls of one case, for valgrind to count (``--count``)."""
    if case in HEDGE_CASES:
        quantile = LatencyQuantile(min_samples=1)
        policy = HedgePolicy(
            2, delay=quantile if case.endswith("LatencyQuantile") else timedelta(milliseconds=10)
        )
        orchestrator = RetryOrchestrator()

        async def send(request: Request, index: int) -> str:
            return "ok"

        async def hedge(n: int) -> None:
            for _ in range(n):
                await orchestrator.hedge(Request(name="get", idempotent=True), send, policy)

        asyncio.run(hedge(200))  # warm up (and give the quantile its delay)
        asyncio.run(hedge(calls))
        return
    if case == "breaker guard()+budget":
        breaker, budget = CircuitBreaker(name="bench:11210"), RetryBudget()
        guard, deposit = breaker.guard, budget.deposit

        def fn() -> str:
            deposit()
            with guard():
                return bare_call()
    elif case == "throttle guard()":
        fn = throttle_variants()["throttle guard()"]
    elif case in ("limiter guard()", "adaptive limiter guard()"):
        limiter = (
            ConcurrencyLimiter(64) if case == "limiter guard()" else AdaptiveConcurrencyLimiter()
        )
        permit = limiter.guard

        def fn() -> str:
            with permit():
                return bare_call()
    else:
        fn = hedge_bookkeeping_variants()["bare" if case == "bare" else case]
    for _ in range(calls):
        fn()


def count(case: str, calls: int) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--count",
            case,
            str(calls),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from valgrind: {out.stderr[-500:]}")
    return int(found.group(1))


def instructions() -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (Debian: apt-get install valgrind)")
    print("instructions per call (valgrind, 3N - N calls over 2N)")
    for case, n in [(c, 20_000) for c in CASES] + [(c, 2_000) for c in HEDGE_CASES]:
        per_call = (count(case, 3 * n) - count(case, n)) / (2 * n)
        print(f"{case:<24} {per_call:>10,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hedged", type=int, default=2_000, help="hedge() calls per round")
    parser.add_argument("--hedged-rounds", type=int, default=41)
    parser.add_argument("--instructions", action="store_true", help="valgrind's counts")
    parser.add_argument("--count", nargs=2, metavar=("CASE", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count is not None:
        run_case(args.count[0], int(args.count[1]))
        return
    if args.instructions:
        instructions()
        return
    print(f"python {sys.version.split()[0]}, {args.calls} calls x {args.rounds} rounds")
    print("\n# AdaptiveThrottle, successful call")
    measure(throttle_variants(), args.calls, args.rounds)
    print("\n# hedging delay bookkeeping per request")
    measure(hedge_bookkeeping_variants(), args.calls, args.rounds)
    print(
        f"\n# RetryOrchestrator.hedge, asyncio, {args.hedged} calls x {args.hedged_rounds} rounds"
    )
    asyncio.run(hedged_rounds(args.hedged, args.hedged_rounds))


if __name__ == "__main__":
    main()
