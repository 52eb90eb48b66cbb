"""Hedged requests against a long-tail server: latency percentiles with and without hedging.

A loopback grpc.aio server (its own process) answers 98% of attempts in 1-3 ms and
2% in 200-1000 ms: exactly 1 slow attempt in every 50, at a seeded random place,
drawn apart for first attempts and for hedges (so hedging neither adds to nor takes
from the first attempts' tail). The same requests are sent at the same concurrency
through a plain grpc.aio channel (no hedging) and through an sdkcore channel whose
service config hedges the method (2 attempts, 20 ms hedging delay); a last row sends
them to the same server with the tail removed (the best any hedging could reach).
Then the generic runner alone (``RetryOrchestrator.hedge``) on an in-process
``send`` with the same long tail.

Those rows run in this process, one after another. A further panel runs every client
in a fresh process of its own, against the same server: grpc.aio without hedging,
the hedged sdkcore channel, grpc-js (the Node gRPC client, which implements A6
hedging) without and with the same service config, and the no-tail reference. It
needs node and ``npm ci --prefix bench/grpcjs``; without them it prints why it was
skipped.

    npm ci --prefix bench/grpcjs
    uv run --group bench python bench/bench_hedge.py [--only grpc|grpcjs|generic] [--requests N]

Prints p50 / p99 / p99.9 / max and the extra attempts the server saw, side by side,
and, for a run of every panel, writes bench/hedge_latency_cdf.png (when matplotlib is
installed).
"""

from __future__ import annotations

import os

# grpc core logs at INFO unless told otherwise, and reads this once, at import.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import json
import logging
import multiprocessing
import random
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import grpc
import structlog
from grpc import aio

from sdkcore import HedgePolicy, Request, RetryOrchestrator
from sdkcore.grpc import insecure_channel

METHOD = "/bench.Svc/Get"
#: The same server with the tail removed: what perfect, free hedging could reach at best.
NO_TAIL = "/bench.Svc/GetNoTail"
COUNT = "/bench.Svc/Count"
SLOW_ONE_IN = 50  # 2% of attempts are slow
#: Sent by every hedge after the first (A6): the server draws their durations apart.
PREVIOUS = "grpc-previous-rpc-attempts"
FAST = (0.001, 0.003)
SLOW = (0.2, 1.0)
HEDGE_DELAY = "0.02s"
CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "bench.Svc"}],
                "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": HEDGE_DELAY},
            }
        ]
    }
)
SCRIPT = Path(__file__).resolve()
PLOT = SCRIPT.parent / "hedge_latency_cdf.png"
#: The grpc-js client (``npm ci --prefix bench/grpcjs`` installs its one dependency).
GRPCJS = SCRIPT.parent / "grpcjs"
GRPCJS_PACKAGE = GRPCJS / "node_modules" / "@grpc" / "grpc-js" / "package.json"


class LongTail:
    """Attempt durations: 1 slow attempt in every block of 50, at a random place."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.block: list[bool] = []

    def next(self) -> float:
        if not self.block:
            self.block = [False] * SLOW_ONE_IN
            self.block[self.rng.randrange(SLOW_ONE_IN)] = True
        slow = self.block.pop()
        return self.rng.uniform(*(SLOW if slow else FAST))


def serve(conn: Any, seed: int) -> None:
    """The server process: reports its port on ``conn``, serves until terminated."""

    async def main() -> None:
        first, hedges = LongTail(seed), LongTail(seed + 2)
        fast = random.Random(seed + 1)
        attempts = [0]

        async def get(request: bytes, context: Any) -> bytes:
            attempts[0] += 1
            hedge = any(k == PREVIOUS for k, _ in context.invocation_metadata())
            await asyncio.sleep((hedges if hedge else first).next())
            return b"value"

        async def get_no_tail(request: bytes, context: Any) -> bytes:
            attempts[0] += 1
            await asyncio.sleep(fast.uniform(*FAST))
            return b"value"

        async def count(request: bytes, context: Any) -> bytes:
            return str(attempts[0]).encode()

        class Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
            def service(self, details: Any) -> Any:
                if details.method == METHOD:
                    return grpc.unary_unary_rpc_method_handler(get)
                if details.method == NO_TAIL:
                    return grpc.unary_unary_rpc_method_handler(get_no_tail)
                if details.method == COUNT:
                    return grpc.unary_unary_rpc_method_handler(count)
                return None

        server = aio.server()
        server.add_generic_rpc_handlers((Handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def drive(
    call: Callable[[], Awaitable[Any]],
    requests: int,
    concurrency: int,
    rate: float | None = None,
) -> list[float]:
    """Latencies (seconds) of ``requests`` calls.

    Closed loop (``rate`` None): ``concurrency`` workers, each sending its next
    request when the previous one ends. Open loop: a request starts every
    ``1 / rate`` seconds whatever is in flight, and its latency counts from its
    scheduled start (queueing in the client included).
    """
    latencies: list[float] = []
    cpu = time.process_time()
    wall = time.perf_counter()
    if rate is None:
        left = [requests]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                t0 = time.perf_counter()
                await call()
                latencies.append(time.perf_counter() - t0)

        async with anyio.create_task_group() as tg:  # anyio: bench_hedge_cost runs it on trio
            for _ in range(concurrency):
                tg.start_soon(worker)
    else:

        async def one(t0: float) -> None:
            await call()
            latencies.append(time.perf_counter() - t0)

        tasks = []
        for i in range(requests):
            due = wall + i / rate
            pause = due - time.perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)
            tasks.append(asyncio.ensure_future(one(due)))
        await asyncio.gather(*tasks)
    CPU_US.append((time.process_time() - cpu) / requests * 1e6)
    RATE.append(requests / (time.perf_counter() - wall))
    return latencies


#: Requests per second achieved by each drive() call, in order.
RATE: list[float] = []
#: Client CPU time per request (µs) of each drive() call, in order.
CPU_US: list[float] = []


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100.0 * len(ordered)) - 1))
    return ordered[k]


def summary(latencies: list[float], attempts: int) -> dict[str, float]:
    n = len(latencies)
    return {
        "p50": pct(latencies, 50) * 1000,
        "p99": pct(latencies, 99) * 1000,
        "p99.9": pct(latencies, 99.9) * 1000,
        "max": max(latencies) * 1000,
        "extra": (attempts - n) / n * 100.0,
    }


async def server_attempts(target: str) -> int:
    async with aio.insecure_channel(target) as ch:
        return int(await ch.unary_unary(COUNT)(b""))


async def measure(
    variants: dict[str, Callable[[], Awaitable[Any]]],
    attempts: Callable[[], Awaitable[int]],
    requests: int,
    concurrency: int,
    rounds: int,
    rate: float | None,
) -> dict[str, Any]:
    """Each variant in turn, ``rounds`` times (machine drift hits all alike); pooled."""
    lat: dict[str, list[float]] = {k: [] for k in variants}
    extra: dict[str, int] = dict.fromkeys(variants, 0)
    cpu: dict[str, float] = dict.fromkeys(variants, 0.0)
    rps: dict[str, float] = dict.fromkeys(variants, 0.0)
    for call in variants.values():
        await drive(call, 200, concurrency)  # warm up connections and caches
    per_round = max(1, requests // rounds)
    for _ in range(rounds):
        for label, call in variants.items():
            before = await attempts()
            lat[label] += await drive(call, per_round, concurrency, rate)
            extra[label] += await attempts() - before
            cpu[label] += CPU_US[-1] / rounds
            rps[label] += RATE[-1] / rounds
    return rows(variants, lat, extra, cpu, rps)


def rows(
    labels: Any,
    lat: dict[str, list[float]],
    extra: dict[str, int],
    cpu: dict[str, float],
    rps: dict[str, float],
) -> dict[str, Any]:
    """Each client's latencies and its summary row (percentiles, extra attempts, CPU, rate)."""
    out: dict[str, Any] = {}
    for label in labels:
        s = summary(lat[label], extra[label])
        s["cpu"] = cpu[label]
        s["rps"] = rps[label]
        out[label] = (lat[label], s)
    return out


async def grpc_runs(
    target: str, requests: int, concurrency: int, rounds: int, rate: float | None
) -> dict[str, Any]:
    async with (
        aio.insecure_channel(target) as plain,
        insecure_channel(target) as unhedged,
        insecure_channel(target, service_config=CONFIG) as hedged,
    ):
        a, b, c = (ch.unary_unary(METHOD) for ch in (plain, unhedged, hedged))
        d = plain.unary_unary(NO_TAIL)
        variants: dict[str, Callable[[], Awaitable[Any]]] = {
            "grpc.aio channel, no hedging": lambda: a(b"k"),
            "sdkcore channel, no hedging policy": lambda: b(b"k"),
            f"sdkcore channel, hedged (2 attempts, {HEDGE_DELAY})": lambda: c(b"k"),
            NO_TAIL_GRPC: lambda: d(b"k"),
        }
        return await measure(
            variants, lambda: server_attempts(target), requests, concurrency, rounds, rate
        )


async def runner_runs(
    requests: int, concurrency: int, rounds: int, rate: float | None
) -> dict[str, Any]:
    """The generic runner alone, on an in-process send with the same long tail."""
    orchestrator = RetryOrchestrator()
    policy = HedgePolicy(2, delay=0.02)
    first, hedges = LongTail(7), LongTail(9)
    fast = random.Random(8)
    attempts = [0]

    async def send(request: Request, index: int = 0) -> bytes:
        attempts[0] += 1
        await asyncio.sleep((hedges if index else first).next())
        return b"value"

    async def no_tail() -> bytes:
        attempts[0] += 1
        await asyncio.sleep(fast.uniform(*FAST))
        return b"value"

    async def plain() -> Any:
        return await send(Request(name="get", idempotent=True, timeout=5.0))

    async def hedged() -> Any:
        request = Request(name="get", idempotent=True, timeout=5.0)
        return await orchestrator.hedge(request, send, policy)

    async def count() -> int:
        return attempts[0]

    variants: dict[str, Callable[[], Awaitable[Any]]] = {
        "send, no hedging": plain,
        "RetryOrchestrator.hedge (2 attempts, 20 ms)": hedged,
        NO_TAIL_RUNNER: no_tail,
    }
    return await measure(variants, count, requests, concurrency, rounds, rate)


async def client_run(args: argparse.Namespace) -> None:
    """``--client``: one closed-loop run in this (fresh) process, as JSON on stdout.

    The same protocol as bench/grpcjs/client.js: connect, ``--warmup`` calls, read
    the server's attempt counter, the measured calls, read it again.
    """
    channel = (
        insecure_channel(args.target, service_config=CONFIG)
        if args.client == "sdkcore"
        else aio.insecure_channel(args.target)
    )
    async with channel:
        await channel.channel_ready()
        stub = channel.unary_unary(args.method)
        if args.warmup > 0:
            await drive(lambda: stub(b"k"), args.warmup, args.concurrency)
        before = await server_attempts(args.target)
        latencies = await drive(lambda: stub(b"k"), args.requests, args.concurrency)
        attempts = await server_attempts(args.target) - before
    print(
        json.dumps(
            {
                "client": args.client,
                "latencies": latencies,
                "attempts": attempts,
                "cpu_us": CPU_US[-1],
                "rps": RATE[-1],
            }
        )
    )


def grpcjs_missing() -> str | None:
    """Why the grpc-js panel cannot run, or None."""
    if shutil.which("node") is None:
        return "node is not on PATH"
    if not GRPCJS_PACKAGE.is_file():
        return "run `npm ci --prefix bench/grpcjs` first"
    return None


def grpcjs_version() -> str:
    version: str = json.loads(GRPCJS_PACKAGE.read_text())["version"]
    return version


async def run_client(argv: list[str]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {proc.returncode}: {err.decode()}")
    result: dict[str, Any] = json.loads(out)
    return result


#: Row labels of the fresh-process panel (grpc-js rows get its version appended).
FRESH_PLAIN = "grpc.aio channel, no hedging"
FRESH_SDKCORE = f"sdkcore channel, hedged (2 attempts, {HEDGE_DELAY})"
FRESH_JS_PLAIN = "grpc-js {}, no hedging"
FRESH_JS_HEDGED = f"grpc-js {{}}, hedged (2 attempts, {HEDGE_DELAY})"


async def fresh_runs(
    target: str, requests: int, concurrency: int, rounds: int, warmup: int
) -> dict[str, Any]:
    """Every client in a fresh process per round, against the same server.

    ``rounds`` rounds; in each, every client runs ``requests / rounds`` calls in a
    process of its own (``warmup`` calls first, not counted), in an order that
    rotates from one round to the next. Pooled as in :func:`measure`.
    """
    version = grpcjs_version()
    per_round = max(1, requests // rounds)
    common = ["--target", target, "--requests", str(per_round)]
    common += ["--concurrency", str(concurrency), "--warmup", str(warmup)]
    py = [sys.executable, str(SCRIPT)]
    js = ["node", str(GRPCJS / "client.js")]
    variants = {
        FRESH_PLAIN: [*py, "--client", "grpc.aio", "--method", METHOD],
        FRESH_SDKCORE: [*py, "--client", "sdkcore", "--method", METHOD],
        FRESH_JS_PLAIN.format(version): [*js, "--method", METHOD],
        FRESH_JS_HEDGED.format(version): [*js, "--method", METHOD, "--service-config", CONFIG],
        NO_TAIL_GRPC: [*py, "--client", "grpc.aio", "--method", NO_TAIL],
    }
    labels = list(variants)
    lat: dict[str, list[float]] = {k: [] for k in labels}
    attempts: dict[str, int] = dict.fromkeys(labels, 0)
    cpu: dict[str, float] = dict.fromkeys(labels, 0.0)
    rps: dict[str, float] = dict.fromkeys(labels, 0.0)
    for i in range(rounds):
        k = i % len(labels)
        for label in labels[k:] + labels[:k]:
            run = await run_client(variants[label] + common)
            lat[label] += run["latencies"]
            attempts[label] += run["attempts"]
            cpu[label] += run["cpu_us"] / rounds
            rps[label] += run["rps"] / rounds
    return rows(labels, lat, attempts, cpu, rps)


def head_to_head(results: dict[str, Any]) -> str:
    """The fresh-process panel: each hedged client against its own unhedged run,
    and sdkcore against grpc-js on p50, p99.9 and extra attempts at once."""
    (_, plain), (_, sd), (_, js_plain), (_, js) = list(results.values())[:4]

    def cut(base: dict[str, float], hedged: dict[str, float]) -> str:
        ratio = base["p99.9"] / hedged["p99.9"]
        ok = ratio >= 25 and hedged["extra"] <= 2.0
        return (
            f"p99.9 cut {ratio:.1f}x at {hedged['extra']:.2f}% extra attempts "
            f"(>= 25x at <= 2%: {'met' if ok else 'NOT met'})"
        )

    better = sd["p50"] <= js["p50"] and sd["p99.9"] <= js["p99.9"] and sd["extra"] <= js["extra"]
    return (
        f"sdkcore: {cut(plain, sd)}, p50 ratio to grpc.aio {sd['p50'] / plain['p50']:.3f}; "
        f"grpc-js: {cut(js_plain, js)} against its own unhedged run "
        f"({plain['p99.9'] / js['p99.9']:.1f}x against grpc.aio unhedged), "
        f"p50 ratio {js['p50'] / js_plain['p50']:.3f}; sdkcore / grpc-js: "
        f"p50 {sd['p50'] / js['p50']:.3f}, p99.9 {sd['p99.9'] / js['p99.9']:.3f}, "
        f"extra attempts {sd['extra']:.2f}% vs {js['extra']:.2f}% "
        f"(no worse on all three: {'yes' if better else 'NO'})"
    )


def table(results: dict[str, Any]) -> str:
    lines = [
        "| run | p50 ms | p99 ms | p99.9 ms | max ms | extra attempts | completed req/s "
        "| client CPU / req |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, (_, s) in results.items():
        lines.append(
            f"| {label} | {s['p50']:.2f} | {s['p99']:.1f} | {s['p99.9']:.1f} | "
            f"{s['max']:.0f} | {s['extra']:.2f}% | {s['rps']:.0f} | {s['cpu']:.0f} µs |"
        )
    return "\n".join(lines)


#: Reference rows: the same load on a server (a send) without the tail, no hedging.
NO_TAIL_GRPC = "grpc.aio channel, server without the tail (reference)"
NO_TAIL_RUNNER = "send without the tail (reference)"


def verdict(results: dict[str, Any]) -> str:
    """The targets, judged on the first row (no hedging) and the hedged row.

    The last row is the reference: the same server with its tail removed, which
    is what perfect hedging at no cost would reach. Its p50 tells how much of the
    hedged p50 comes from the load hedging lets through (more requests per
    second in a closed loop) rather than from hedging itself.
    """
    runs = list(results.values())
    (_, base), (_, hedged), (_, ref) = runs[0], runs[-2], runs[-1]
    cut = base["p99.9"] / hedged["p99.9"]
    p50 = hedged["p50"] / base["p50"]
    ok_cut = cut >= 25 and hedged["extra"] <= 2.0
    text = (
        f"p99.9 cut {cut:.1f}x at {hedged['extra']:.2f}% extra attempts "
        f"(target >= 25x at <= 2%: {'met' if ok_cut else 'NOT met'}); "
        f"hedged p50 / unhedged p50 = {p50:.3f} (target <= 1.10: "
        f"{'met' if p50 <= 1.10 else 'NOT met'})"
    )
    if len(runs) > 3:
        same = runs[1][1]
        text += (
            f"; against the same sdkcore channel without a hedging policy: p99.9 cut "
            f"{same['p99.9'] / hedged['p99.9']:.1f}x, p50 ratio {hedged['p50'] / same['p50']:.3f}"
        )
    text += (
        f"; reference without the tail: p50 {ref['p50']:.2f} ms at {ref['rps']:.0f} req/s "
        f"(ratio to unhedged {ref['p50'] / base['p50']:.3f}), hedged p50 / reference p50 = "
        f"{hedged['p50'] / ref['p50']:.3f}"
    )
    return text


def plot(panels: list[tuple[str, dict[str, Any]]]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot (uv run --group bench ...)"
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.2 * rows), squeeze=False)
    for ax, (title, results) in zip(axes.flat, panels, strict=False):
        for label, (lat, _) in results.items():
            ordered = sorted(x * 1000 for x in lat)
            n = len(ordered)
            ax.plot(ordered, [(i + 0.5) / n for i in range(n)], label=label)
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title, fontsize=10)
        ax.set_yscale("logit")  # the median and the tail (p99.9) both readable
        ax.set_ylim(0.05, 0.9999)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("Latency CDF (logit scale), 98% of attempts 1-3 ms, 2% 200-1000 ms")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return f"plot written to {PLOT}"


async def main_async(args: argparse.Namespace, target: str) -> None:
    started = time.perf_counter()
    closed = f"closed loop, concurrency {args.concurrency}"
    opened = f"open loop, {args.rate:.0f} requests/s"
    n, m, c, r = args.requests, args.open_requests, args.concurrency, args.rounds
    fresh = f"gRPC against grpc-js, {closed}, a fresh client process per run"
    panels: list[tuple[str, dict[str, Any]]] = []
    panel_runs: list[tuple[str, str, Callable[[], Awaitable[dict[str, Any]]]]] = [
        ("grpc", f"gRPC, {closed}", lambda: grpc_runs(target, n, c, r, None)),
        ("grpc", f"gRPC, {opened}", lambda: grpc_runs(target, m, c, r, args.rate)),
        ("grpcjs", fresh, lambda: fresh_runs(target, n, c, r, args.fresh_warmup)),
        ("generic", f"generic runner, {closed}", lambda: runner_runs(n, c, r, None)),
        ("generic", f"generic runner, {opened}", lambda: runner_runs(m, c, r, args.rate)),
    ]
    for key, title, runs in panel_runs:
        if args.only and key != args.only:
            continue
        if key == "grpcjs" and (why := grpcjs_missing()):
            print(f"### {title}\n\nskipped: {why}\n", flush=True)
            continue
        results = await runs()
        panels.append((title, results))
        print(f"### {title}\n")
        print(table(results))
        judge = head_to_head if key == "grpcjs" else verdict
        print("\n" + judge(results) + "\n", flush=True)
    if args.only:  # the committed plot shows every panel of one run
        print("--only: no plot written")
    else:
        print(plot(panels))
    print(f"took {time.perf_counter() - started:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="per closed-loop run")
    parser.add_argument("--open-requests", type=int, default=2500, help="per open-loop run")
    parser.add_argument("--rate", type=float, default=300.0, help="open-loop requests/s")
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--only",
        choices=("grpc", "grpcjs", "generic"),
        help="run only the in-process gRPC panels, the fresh-process panel against grpc-js, "
        "or the generic-runner panels",
    )
    parser.add_argument(
        "--fresh-warmup",
        type=int,
        default=200,
        help="uncounted calls each fresh client process sends before its measured calls "
        "(the in-process panels warm up with 200 too); 0 puts connection reuse and first "
        "calls on the clock",
    )
    parser.add_argument(
        "--client",
        choices=("grpc.aio", "sdkcore"),
        help="internal, for the fresh-process panel: run one client against --target "
        "(--method, --requests, --concurrency, --warmup) and print JSON",
    )
    parser.add_argument("--target", help="with --client: host:port of a running server")
    parser.add_argument("--method", default=METHOD, help="with --client")
    parser.add_argument("--warmup", type=int, default=200, help="with --client")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    if args.client:
        asyncio.run(client_run(args))
        return
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, args.seed), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        asyncio.run(main_async(args, f"127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.join(5)


if __name__ == "__main__":
    main()
