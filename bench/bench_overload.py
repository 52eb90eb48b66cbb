"""2x overload on loopback: no limiter, the adaptive limiter, and the SRE throttle.

Run:  uv run python bench/bench_overload.py [--capacity 2] [--service-ms 10] [--seconds 6]
                                            [--timeout-x 25] [--initial-limit 20]

A real memcached behind the tests' fault proxy (tests/memcached/fault_proxy.py)
made a server of fixed capacity: at most ``capacity`` requests in service at a
time, each for ``service-ms`` before it goes on to memcached, so it serves
``capacity / service`` requests/s. The example client (sdkcore.examples.memcached,
timeout ``timeout-x`` service times) sends GETs open loop:

1. unloaded: half the capacity, no limiter, BestEffort (the unloaded latency);
2. 2x capacity, no limiter, BestEffort: the proxy queues what it cannot serve (and
   still serves requests the client gave up on, as a real server does);
3. 2x capacity, ``AdaptiveConcurrencyLimiter()`` (defaults: 20, 1, 200; no queue)
   with ``FailFastRetryStrategy``: a refusal ends the request at once, as a caller
   that sheds load wants (Netflix's and Envoy's limiters answer 503 at once). The
   issue's targets are read on this row;
4. the same with BestEffort, which retries every refusal: the answered requests'
   latency then holds their waits for a permit, and the excess is offered again;
5. 2x capacity against a server that answers TMPFAIL at once when every slot is
   busy: without a throttle, then with ``AdaptiveThrottle(k=2, window=10 s)``.

From ``initial_limit=20`` the limiter first learns the endpoint (a queue 18 deep,
its warm-up, one probe: one to two seconds); the targets are read on each row's
second half, and the whole row is printed beside them.

Outcomes: ``ok`` (answered), ``cut`` (a timeout while an attempt was in flight: sent,
unanswered by the deadline), ``late`` (ended between attempts: timed out after
refusals, TMPFAIL answers or connection resets, or failed at once under FailFast).
Latency of answered requests is from the first attempt to the answer. ``over`` is
the most any request ran past its deadline. The throttle rows count frames that
reached the server per accepted one. Needs memcached (apt-get install memcached).
Total run: about 35 s.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "memcached"))

from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    BestEffortRetryStrategy,
    CouchbaseException,
    FailFastRetryStrategy,
    RetryOrchestrator,
)
from sdkcore._adaptive_limiter import AdaptiveConcurrencyLimiter
from sdkcore._throttle import AdaptiveThrottle
from sdkcore.examples.memcached import MemcachedClient


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(
    proxy: FaultProxy,
    rate: float,
    seconds: float,
    request_timeout: float,
    limiter: Callable[[str], Any] | None = None,
    throttle: Callable[[str], Any] | None = None,
    fail_fast: bool = False,
) -> dict[str, Any]:
    strategy = FailFastRetryStrategy() if fail_fast else BestEffortRetryStrategy()
    orchestrator = RetryOrchestrator(strategy)
    latencies: list[float] = []
    tail: list[float] = []  # answered in the second half (the limiter has learned)
    outcomes = {"ok": 0, "cut": 0, "late": 0}
    over = 0.0
    sent = 0
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=orchestrator,
        timeout=request_timeout,
        limiter=limiter,
        throttle=throttle,
    ) as client:
        await client.set("k", b"v")
        proxy.reset_counts()
        start = anyio.current_time()
        half = start + seconds / 2

        async def one() -> None:
            nonlocal over
            began = time.monotonic()
            try:
                await client.get("k")
            except CouchbaseException as exc:
                context = exc.context
                if context is not None and context.in_flight:
                    outcomes["cut"] += 1
                else:
                    outcomes["late"] += 1
            else:
                outcomes["ok"] += 1
                latencies.append(time.monotonic() - began)
                if anyio.current_time() >= half:
                    tail.append(time.monotonic() - began)
            over = max(over, time.monotonic() - began - request_timeout)

        async with anyio.create_task_group() as tg:
            while (now := anyio.current_time()) < start + seconds:
                due = int((now - start) * rate) + 1
                while sent < due:
                    tg.start_soon(one)
                    sent += 1
                await anyio.sleep(1 / rate)
        limits = [x.limit for x in client.limiters if x is not None]
    _, _, requests = proxy.counts()
    return {
        "sent": sent,
        **outcomes,
        "goodput": outcomes["ok"] / seconds,
        "p50": quantile(latencies, 0.5) * 1e3,
        "p99": quantile(latencies, 0.99) * 1e3,
        "p99 2nd half": quantile(tail, 0.99) * 1e3,
        "goodput 2nd half": len(tail) / (seconds / 2),
        "over": over * 1e3,
        "frames": sum(requests.values()),
        "served": proxy.served,
        "rejected": proxy.rejected,
        "limit": limits[0] if limits else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=2)
    parser.add_argument("--service-ms", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--skip-nolimit", action="store_true")
    parser.add_argument("--initial-limit", type=int, default=20)
    parser.add_argument("--timeout-x", type=float, default=25.0, help="timeout in service times")
    args = parser.parse_args()
    logging.getLogger("sdkcore").setLevel(logging.ERROR)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    binary = shutil.which("memcached")
    if binary is None:
        raise SystemExit("memcached is not installed: apt-get install memcached")
    service = args.service_ms / 1e3
    capacity = args.capacity / service
    timeout = args.timeout_x * service
    server = Memcached(binary).start()
    proxy = FaultProxy(server.port).start()
    header = (
        f"{'variant':<26} {'sent':>5} {'ok':>5} {'cut':>5} {'late':>5} {'goodput/s':>9} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'p99 2nd':>7} {'over ms':>7} {'limit':>5}"
    )

    def row(label: str, r: dict[str, Any]) -> None:
        print(
            f"{label:<26} {r['sent']:>5} {r['ok']:>5} {r['cut']:>5} {r['late']:>5} "
            f"{r['goodput']:>9.0f} {r['p50']:>7.1f} {r['p99']:>7.1f} {r['p99 2nd half']:>7.1f} "
            f"{r['over']:>7.1f} {r['limit'] if r['limit'] is not None else '-':>5}"
        )

    try:
        print(
            f"server: {args.capacity} at a time x {args.service_ms:g} ms = {capacity:.0f}/s; "
            f"GETs open loop for {args.seconds:g} s each, "
            f"timeout {timeout * 1e3:.0f} ms, BestEffort"
        )
        print(header)
        proxy.limit_capacity(args.capacity, service)
        unloaded = anyio.run(run, proxy, capacity / 2, args.seconds, timeout)
        row("unloaded (0.5x)", unloaded)
        if not args.skip_nolimit:
            proxy.limit_capacity(args.capacity, service)
            row("2x, no limiter", anyio.run(run, proxy, 2 * capacity, args.seconds, timeout))
        adaptive: dict[str, dict[str, Any]] = {}
        for label, fail_fast in (("FailFast", True), ("BestEffort", False)):
            proxy.limit_capacity(args.capacity, service)
            adaptive[label] = anyio.run(
                run,
                proxy,
                2 * capacity,
                args.seconds,
                timeout,
                lambda name: AdaptiveConcurrencyLimiter(args.initial_limit, name=name),
                None,
                fail_fast,
            )
            row(f"2x, adaptive, {label}", adaptive[label])
        print()
        for label, r in adaptive.items():
            good = r["goodput 2nd half"] / capacity
            ratio = r["p99 2nd half"] / unloaded["p99"]
            print(
                f"adaptive, {label}, second half: goodput {good:.0%} of capacity "
                f"(target >= 90%: {'met' if good >= 0.9 else 'MISSED'}), p99 {ratio:.2f}x the "
                f"unloaded p99 (target <= 2x: {'met' if ratio <= 2 else 'MISSED'}); whole row: "
                f"goodput {r['goodput'] / capacity:.0%}, p99 {r['p99'] / unloaded['p99']:.2f}x; "
                f"{r['over']:.1f} ms past a deadline at most"
            )
        print()
        print(f"server answering TMPFAIL when its {args.capacity} slots are busy, 2x capacity:")
        print(
            f"{'variant':<26} {'sent':>5} {'ok':>5} {'frames':>7} {'TMPFAIL':>7} {'frames/ok':>9}"
        )
        for label, throttle in [
            ("no throttle", None),
            (
                "throttle k=2",
                lambda name: AdaptiveThrottle(2.0, window=timedelta(seconds=10), name=name),
            ),
        ]:
            proxy.limit_capacity(args.capacity, service, reject=True)
            r = anyio.run(run, proxy, 2 * capacity, args.seconds, timeout, None, throttle)
            print(
                f"{label:<26} {r['sent']:>5} {r['ok']:>5} {r['frames']:>7} {r['rejected']:>7} "
                f"{r['frames'] / max(r['served'], 1):>9.2f}"
            )
    finally:
        proxy.stop()
        server.kill()


if __name__ == "__main__":
    main()
