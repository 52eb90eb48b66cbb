"""An outage at a fixed request rate on loopback: what reaches a dead memcached.

Run:  uv run python bench/bench_outage.py [--rate 200] [--seconds 3]

A real memcached behind the tests' fault proxy (tests/memcached/fault_proxy.py);
memcached is killed, then the example client (sdkcore.examples.memcached) sends
idempotent GETs at a fixed rate for a fixed time with BestEffort retries
(timeout 0.5 s). The proxy counts every request frame that reaches the dead
endpoint (first attempts, re-sends and NOOP probes) and every connection.
Variants: no breaker (one that never trips), the example's breaker (volume 20,
50 %, sleep window 0.5 s), and, when the core has RetryOrchestrator(retry_budget=...),
the budget with and without the breaker. Needs memcached (apt-get install memcached).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "memcached"))

import contextlib

from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CouchbaseException,
    RetryBudget,
    RetryOrchestrator,
)
from sdkcore.examples.memcached import MemcachedClient, endpoint_down
from sdkcore.mapping import KvOpcode

HAS_BUDGET = "retry_budget" in inspect.signature(RetryOrchestrator.__init__).parameters


def never_trips(name: str) -> CircuitBreaker:
    return CircuitBreaker(name=name, is_failure=endpoint_down, volume_threshold=10**9)


def breaker(name: str) -> CircuitBreaker:
    return CircuitBreaker(name=name, is_failure=endpoint_down, sleep_window=0.5)


async def run(
    proxy: FaultProxy,
    rate: float,
    seconds: float,
    factory: Callable[[str], CircuitBreaker],
    budget: bool,
) -> dict[str, int]:
    kwargs: dict[str, Any] = {"retry_budget": RetryBudget()} if budget else {}
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), **kwargs)
    proxy.reset_counts()
    sent = 0
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}", orchestrator=orchestrator, timeout=0.5, breaker=factory
    ) as client:

        async def one(i: int) -> None:
            with contextlib.suppress(CouchbaseException):
                await client.get(f"k{i}")

        async with anyio.create_task_group() as tg:
            start = anyio.current_time()
            while (now := anyio.current_time()) < start + seconds:
                due = int((now - start) * rate) + 1
                while sent < due:
                    tg.start_soon(one, sent)
                    sent += 1
                await anyio.sleep(1 / rate)
    connections, _, requests = proxy.counts()
    return {
        "first attempts": sent,
        "frames at the endpoint": sum(requests.values()),
        "NOOP probes": requests.get(KvOpcode.NOOP, 0),
        "connections": connections,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    logging.getLogger("sdkcore").setLevel(logging.ERROR)  # the breaker's events: not here
    binary = shutil.which("memcached")
    if binary is None:
        raise SystemExit("memcached is not installed: apt-get install memcached")
    variants: list[tuple[str, Callable[[str], CircuitBreaker], bool]] = [
        ("no breaker, no budget", never_trips, False),
        ("breaker", breaker, False),
    ]
    if HAS_BUDGET:
        variants += [("budget", never_trips, True), ("breaker + budget", breaker, True)]
    server = Memcached(binary).start()
    proxy = FaultProxy(server.port).start()
    try:
        server.kill()
        print(f"outage: {args.rate:g} GET/s for {args.seconds:g} s, timeout 0.5 s, BestEffort")
        print(
            f"{'variant':<24} {'first':>7} {'frames':>8} {'per first':>10} "
            f"{'probes':>7} {'conns':>6}"
        )
        for label, factory, budget in variants:
            r = anyio.run(run, proxy, args.rate, args.seconds, factory, budget)
            ratio = r["frames at the endpoint"] / max(r["first attempts"], 1)
            print(
                f"{label:<24} {r['first attempts']:>7} {r['frames at the endpoint']:>8} "
                f"{ratio:>10.2f} {r['NOOP probes']:>7} {r['connections']:>6}"
            )
        if not HAS_BUDGET:
            print("(the budget rows need RetryOrchestrator(retry_budget=...) in the core)")
    finally:
        proxy.stop()
        server.kill()


if __name__ == "__main__":
    main()
