"""Adaptive hedging on a long-tail memcached: LatencyQuantile against fixed delays.

Run:  uv run python bench/bench_hedge_adaptive.py [--seconds 140] [--rate 150] [--tail 0.01]

A real memcached behind the tests' fault proxy (tests/memcached/fault_proxy.py, in
a process of its own so that it never waits for this one's GIL) made a long-tail
server: every request frame is held, independently of every other, ``--body-ms``
(uniform, 1-2 ms by default) or, with probability ``--tail`` (1%), ``--tail-ms``
(50 ms: a GC pause, a slow replica) before it goes on to memcached. A hedged copy
is a GET frame of its own, so it usually escapes the tail its first copy met.

Every variant sends the same idempotent GET through ``RetryOrchestrator.hedge``
(``HedgePolicy(max_attempts=2, ...)``: one backup, as Finagle sends), each copy
through the example client's per-server ``send`` (``MemcachedClient``, one client
and connection per variant). Each copy runs in a task of its own: when one copy
wins, ``hedge`` stops waiting for the other (and records its latency at that
moment, as it always does), but the copy itself is not cancelled. With
``--cancel-losers`` the copy runs in the hedge's task and is cancelled, as a real
caller's would be; the example client then closes its connection whenever the
cancellation lands just after a frame was written (it takes the frame for cut
mid-frame), which fails the other requests in flight on it: the ``conns`` column
counts the connections each variant opened.

* no hedging (``max_attempts=1``: the same code path);
* fixed delays (``--delays``, default 3, 4, 5, 6, 8, 10, 20 ms);
* ``LatencyQuantile(max_extra_load=0.01)``, defaults otherwise (30 s window,
  min_samples 100, min_delay 1 ms).

The variants run at the same time, interleaved request by request (blocks of one
request per variant in a random order; ``--rate`` requests/s per variant, open
loop), so drift of the shared machine hits each alike. The first ``--warmup``
seconds are sent but not counted (the learned delay needs ``min_samples``
latencies first; every variant is warmed alike). Latency: from the call to
``hedge`` to its answer. Extra load: GET frames that reached the proxy for the
counted requests, beyond one per request (each variant and phase reads its own key,
so the proxy counts them apart); ``booked`` is the copies ``hedge`` handed to
``send`` (a copy cut before its frame was written is booked, not sent).

The client and proxy print their CPU, how late their event loops ran, and the
client's garbage collections (it freezes what was alive before the run); a run in
which a request failed or a loop ran more than 50 ms late is flagged as disturbed.

Verdicts (issue 23 item 6): the adaptive p99.9 cut (no-hedge p99.9 - adaptive
p99.9) at least as large as the cut of the best fixed delay in hindsight (the
lowest p99.9 among fixed delays whose extra load is <= max_extra_load + 0.5%), and
the adaptive extra load <= max_extra_load + 0.5%. Needs memcached (apt-get install
memcached). Total run: about 2.5 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import logging
import math
import multiprocessing
import os
import random
import shutil
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import anyio
import anyio.abc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "memcached"))

from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import HedgePolicy, LatencyQuantile, Request, RetryOrchestrator
from sdkcore.examples.memcached import MemcachedClient
from sdkcore.examples.memcached import _protocol as proto
from sdkcore.mapping import KvOpcode, kv_request

GET = int(KvOpcode.GET)
SLACK = 0.005  # the allowance over max_extra_load
STALL = 0.05  # an event loop this late (s) disturbed the latencies measured
VALUE = b"v" * 100
_KEY = struct.Struct(">H")  # key length, at offset 2 of a request header


def key(phase: str, index: int) -> str:
    return f"{phase}{index}"


# -- the long-tail proxy, in a process of its own ------------------------------------------
def _serve_proxy(
    upstream: int,
    body: tuple[float, float],
    tail: float,
    tail_seconds: float,
    seed: int,
    pipe: Connection,
) -> None:
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # handlers cut at stop()
    rng = random.Random(seed)
    drawn = [0, 0]  # frames held, of them in the tail (only the proxy's loop thread writes)
    gets: collections.Counter[bytes] = collections.Counter()  # GET frames by key
    low, high = body

    def latency(frame: bytes) -> float:
        if frame[1] == GET:
            (length,) = _KEY.unpack_from(frame, 2)
            start = 24 + frame[4]  # after the header and the extras
            gets[frame[start : start + length]] += 1
        drawn[0] += 1
        if rng.random() < tail:
            drawn[1] += 1
            return tail_seconds
        return rng.uniform(low, high)

    late: list[float] = []  # how late each 10 ms tick of the proxy's loop ran

    async def tick() -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.01
            await asyncio.sleep(0.01)
            late.append(loop.time() - due)

    proxy = FaultProxy(upstream)
    proxy.request_latency = latency
    proxy.start()
    ticker = asyncio.run_coroutine_threadsafe(tick(), proxy._loop)
    pipe.send(proxy.port)
    try:
        while pipe.recv() == "counts":
            connections, _, requests = proxy.counts()
            pipe.send(
                (
                    requests.get(GET, 0),
                    {k.decode(): n for k, n in list(gets.items())},
                    drawn[0],
                    drawn[1],
                    connections,
                    sorted(late),
                    time.process_time(),
                )
            )
    finally:
        ticker.cancel()
        proxy.stop()


@dataclass
class ProxyCounts:
    gets: int  # GET frames that reached the proxy
    by_key: dict[str, int]
    drawn: int  # frames held (every opcode)
    slow: int  # of them, in the tail
    connections: int
    late: list[float]  # the proxy loop's 10 ms ticks, how late each ran (sorted)
    cpu: float  # the proxy process's CPU seconds


class ProxyProcess:
    def __init__(
        self, upstream: int, body: tuple[float, float], tail: float, tail_s: float, seed: int
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(
            target=_serve_proxy, args=(upstream, body, tail, tail_s, seed, child), daemon=True
        )
        self._process.start()
        if not self._pipe.poll(30):
            self.stop()
            raise RuntimeError("the proxy process did not start")
        self.port: int = self._pipe.recv()

    def counts(self) -> ProxyCounts:
        self._pipe.send("counts")
        return ProxyCounts(*self._pipe.recv())

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._pipe.send("stop")
        self._process.join(timeout=15)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


# -- the variants -----------------------------------------------------------------------------
@dataclass
class Variant:
    label: str
    policy: HedgePolicy
    learned: LatencyQuantile | None = None
    orchestrator: RetryOrchestrator = field(default_factory=RetryOrchestrator)
    latencies: list[float] = field(default_factory=list)  # counted requests, seconds
    started: int = 0  # requests, warm-up included
    failed: int = 0  # counted requests that raised
    booked: int = 0  # copies after the first handed to send, counted requests
    won_by_hedge: int = 0
    connections: int = 0  # connections the client opened (a new one after a drop)
    delays: list[float] = field(default_factory=list)  # the learned delay, sampled (ms)
    trajectory: list[str] = field(default_factory=list)  # the learned delay every 5 s
    first_delay_after: int | None = None  # requests started before the first learned delay
    _connection: object = None


def nearest_rank(ordered: list[float], q: float) -> float:
    """The smallest value with at least ``q`` of the values at or below it."""
    if not ordered:
        return float("nan")
    rank = max(1, -(-round(q * len(ordered) * 1000) // 1000))
    return ordered[min(len(ordered), rank) - 1]


def quantile_interval(ordered: list[float], q: float) -> tuple[float, float]:
    """A 95% interval for the ``q`` quantile of what ``ordered`` sampled, from order
    statistics alone (no assumption on the distribution): the count of values below the
    true quantile is binomial(n, q), so the ranks ``n q -+ 1.96 sqrt(n q (1 - q))``
    bound it. For p99.9 of 21,000 requests: the 13th to the 31st slowest."""
    n = len(ordered)
    if not n:
        return float("nan"), float("nan")
    spread = 1.96 * math.sqrt(n * q * (1.0 - q))
    low = max(1, math.floor(n * q - spread))
    high = min(n, math.ceil(n * q + spread))
    return ordered[low - 1], ordered[high - 1]


async def run(
    port: int,
    variants: list[Variant],
    rate: float,
    seconds: float,
    warmup: float,
    request_timeout: float,
    seed: int,
    cancel_losers: bool,
    stalls: list[float],
    pauses: list[float],
) -> float:
    """Send every variant's requests, interleaved; returns the measured span in seconds.

    Filled here: ``stalls``, how late each 10 ms tick of the event loop ran, and
    ``pauses``, how long each garbage collection took (seconds), while requests ran.
    """
    rng = random.Random(seed)
    clients: list[MemcachedClient] = []
    copies_group: list[anyio.abc.TaskGroup] = []
    collecting = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - collecting[0])

    try:
        for i, _ in enumerate(variants):
            client = MemcachedClient(f"127.0.0.1:{port}", timeout=request_timeout)
            await client.__aenter__()
            clients.append(client)
            for phase in ("w", "m"):
                await client.set(key(phase, i), VALUE)

        async def one(i: int, counted: bool) -> None:
            variant = variants[i]
            endpoint = clients[i]._endpoints[0]  # the example client's per-server send
            frame_key = key("m" if counted else "w", i)
            copies = 0
            winner: list[int] = []

            def build(opaque: int) -> bytes:
                return proto.get_frame(opaque, frame_key)

            async def send(request: Request, index: int) -> bytes:
                nonlocal copies
                copies += 1
                if cancel_losers:
                    response = await endpoint.send(request, KvOpcode.GET, build)
                else:
                    response = await detached(request)
                winner.append(index)
                return response.value

            async def detached(request: Request) -> proto.Response:
                """The copy in a task of its own: cutting the hedge stops the wait, not it."""
                box: list[proto.Response | Exception] = []
                done = anyio.Event()

                async def copy() -> None:
                    try:
                        box.append(await endpoint.send(request, KvOpcode.GET, build))
                    except Exception as exc:
                        box.append(exc)
                    finally:
                        done.set()

                copies_group[0].start_soon(copy)
                await done.wait()
                if isinstance(box[0], Exception):
                    raise box[0]
                return box[0]

            request = kv_request(KvOpcode.GET, timeout=request_timeout)
            began = time.monotonic()
            try:
                await variant.orchestrator.hedge(request, send, variant.policy)
            except Exception as exc:
                if os.environ.get("DBG"):
                    print(repr(exc)[:500], repr(exc.__cause__)[:300])
                if counted:
                    variant.failed += 1
            else:
                if counted:
                    variant.latencies.append(time.monotonic() - began)
                    variant.booked += copies - 1
                    variant.won_by_hedge += bool(winner) and winner[0] > 0
            connection = endpoint._connection
            if connection is not variant._connection:
                variant._connection = connection
                variant.connections += 1
            learned = variant.learned
            if (
                learned is not None
                and variant.first_delay_after is None
                and learned.current_delay is not None
            ):
                variant.first_delay_after = variant.started

        async def tick() -> None:
            while True:
                due = anyio.current_time() + 0.01
                await anyio.sleep(0.01)
                stalls.append(anyio.current_time() - due)

        async def watch() -> None:
            ticks = 0
            while True:
                await anyio.sleep(0.5)
                ticks += 1
                for variant in variants:
                    if variant.learned is None:
                        continue
                    delay = variant.learned.current_delay
                    ms = None if delay is None else delay.total_seconds() * 1e3
                    if ticks % 10 == 0:
                        variant.trajectory.append("-" if ms is None else f"{ms:.1f}")
                    if ms is not None and anyio.current_time() >= measure_from:
                        variant.delays.append(ms)

        # What is alive now (modules, clients) lives to the end: out of the collector's
        # way, so a full collection scans only what the run itself makes.
        gc.collect()
        gc.freeze()
        gc.callbacks.append(on_gc)
        order = list(range(len(variants)))
        block = len(variants)
        total_rate = rate * block
        start = anyio.current_time()
        measure_from = start + warmup
        end = measure_from + seconds
        async with anyio.create_task_group() as tg:
            copies_group.append(tg)
            tg.start_soon(watch)
            tg.start_soon(tick)
            sent = 0
            while (now := anyio.current_time()) < end:
                due = int((now - start) * total_rate) + 1
                while sent < due:
                    if sent % block == 0:
                        rng.shuffle(order)
                    i = order[sent % block]
                    variants[i].started += 1
                    tg.start_soon(one, i, now >= measure_from)
                    sent += 1
                await anyio.sleep(1 / total_rate)
            measured = anyio.current_time() - measure_from
            await anyio.sleep(request_timeout + 0.1)  # the last requests end
            tg.cancel_scope.cancel()
        return measured
    finally:
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
        gc.unfreeze()
        for client in reversed(clients):
            await client.__aexit__(None, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=140.0, help="measured time")
    parser.add_argument("--warmup", type=float, default=5.0, help="sent, not counted")
    parser.add_argument("--rate", type=float, default=150.0, help="GETs/s per variant")
    parser.add_argument("--body-ms", type=float, nargs=2, default=(1.0, 2.0))
    parser.add_argument("--tail", type=float, default=0.01, help="share of frames in the tail")
    parser.add_argument("--tail-ms", type=float, default=50.0)
    parser.add_argument(
        "--delays", type=float, nargs="+", default=(3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 20.0)
    )
    parser.add_argument("--max-extra-load", type=float, default=0.01)
    parser.add_argument(
        "--also",
        type=float,
        nargs="*",
        default=(),
        help="more LatencyQuantile rows with these max_extra_load (no verdict)",
    )
    parser.add_argument("--window", type=float, default=30.0, help="LatencyQuantile window, s")
    parser.add_argument("--min-samples", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=1.0, help="request timeout, s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cancel-losers",
        action="store_true",
        help="run each copy in the hedge's own task (cut when another wins), not detached",
    )
    args = parser.parse_args()
    logging.getLogger("sdkcore").setLevel(logging.ERROR)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    binary = shutil.which("memcached")
    if binary is None:
        raise SystemExit("memcached is not installed: apt-get install memcached")
    budget = args.max_extra_load + SLACK

    variants = [Variant("no hedging", HedgePolicy(max_attempts=1))]
    for delay in args.delays:
        policy = HedgePolicy(max_attempts=2, delay=timedelta(milliseconds=delay))
        variants.append(Variant(f"fixed {delay:g} ms", policy))
    defaults = args.window == 30.0 and args.min_samples == 100
    adaptives: list[Variant] = []
    for extra in [args.max_extra_load, *args.also]:
        learned = LatencyQuantile(
            extra, window=timedelta(seconds=args.window), min_samples=args.min_samples
        )
        label = f"LatencyQuantile({extra:g})" + ("" if defaults else "*")
        adaptives.append(Variant(label, HedgePolicy(max_attempts=2, delay=learned), learned))
    variants += adaptives
    adaptive = adaptives[0]

    server = Memcached(binary).start()
    proxy: ProxyProcess | None = None
    load_before = os.getloadavg()
    try:
        proxy = ProxyProcess(
            server.port,
            (args.body_ms[0] / 1e3, args.body_ms[1] / 1e3),
            args.tail,
            args.tail_ms / 1e3,
            args.seed,
        )
        print(
            f"server: each frame held {args.body_ms[0]:g}-{args.body_ms[1]:g} ms, or "
            f"{args.tail_ms:g} ms with probability {args.tail:.2%} (drawn per frame); "
            f"{len(variants)} variants interleaved, {args.rate:g} GETs/s each, open loop, "
            f"{args.warmup:g} s warm-up + {args.seconds:g} s counted; "
            f"LatencyQuantile window {args.window:g} s, min_samples {args.min_samples}"
        )
        stalls: list[float] = []
        pauses: list[float] = []
        cpu = time.process_time()
        measured = anyio.run(
            run,
            proxy.port,
            variants,
            args.rate,
            args.seconds,
            args.warmup,
            args.timeout,
            args.seed,
            args.cancel_losers,
            stalls,
            pauses,
        )
        cpu = time.process_time() - cpu
        counts = proxy.counts()
    finally:
        if proxy is not None:
            proxy.stop()
        server.kill()
    load_after = os.getloadavg()

    print(
        f"proxy: {counts.gets} GET frames; {counts.slow}/{counts.drawn} frames "
        f"({counts.slow / max(counts.drawn, 1):.2%}) held in the tail; "
        f"{counts.connections} connections for {len(variants)} clients; "
        f"counted {measured:.1f} s; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    span = measured + args.warmup
    for name, late, used in (
        ("client", sorted(stalls), cpu),
        ("proxy", counts.late, counts.cpu),
    ):
        print(
            f"{name}: CPU {used / span:.0%} of a core; event loop 10 ms ticks late by p99 "
            f"{nearest_rank(late, 0.99) * 1e3:.1f} ms, max {late[-1] * 1e3:.1f} ms, "
            f"{sum(x > 0.005 for x in late)} of {len(late)} by > 5 ms"
        )
    print(
        f"client: {len(pauses)} GC collections, longest {max(pauses, default=0.0) * 1e3:.1f} ms; "
        + (
            "copies cut when another wins (--cancel-losers)"
            if args.cancel_losers
            else "each copy runs detached (a cut hedge stops waiting for it)"
        )
    )
    print()
    print(
        "| variant | requests | p50 ms | p99 ms | p99.9 ms | max ms | extra load | booked | "
        f"won by hedge | >= {args.tail_ms:g} ms | conns | p99.9 cut ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    results: dict[str, dict[str, float]] = {}
    for i, variant in enumerate(variants):
        ordered = sorted(variant.latencies)
        frames = counts.by_key.get(key("m", i), 0)
        requests = len(ordered) + variant.failed
        results[variant.label] = {
            "n": len(ordered),
            "p50": nearest_rank(ordered, 0.5) * 1e3,
            "p99": nearest_rank(ordered, 0.99) * 1e3,
            "p999": nearest_rank(ordered, 0.999) * 1e3,
            "p999_95": tuple(x * 1e3 for x in quantile_interval(ordered, 0.999)),
            "max": (ordered[-1] if ordered else float("nan")) * 1e3,
            "extra": (frames - requests) / max(requests, 1),
            "booked": variant.booked / max(requests, 1),
            "won": variant.won_by_hedge / max(requests, 1),
            "slow": sum(x >= args.tail_ms / 1e3 for x in ordered) + variant.failed,
        }
    base = results[variants[0].label]["p999"]
    for variant in variants:
        r = results[variant.label]
        failed = f" ({variant.failed} failed)" if variant.failed else ""
        print(
            f"| {variant.label} | {r['n']:.0f}{failed} | {r['p50']:.2f} | {r['p99']:.2f} | "
            f"{r['p999']:.2f} | {r['max']:.1f} | {r['extra']:.2%} | {r['booked']:.2%} | "
            f"{r['won']:.2%} | {r['slow']:.0f} | {variant.connections} | "
            f"{base - r['p999']:.2f} |"
        )
    print()
    for variant in adaptives:
        ds = variant.delays
        if not ds:
            print(f"{variant.label}: no learned delay while counting")
            continue
        print(
            f"{variant.label} delay, every 0.5 s while counting: min {min(ds):.2f} ms, "
            f"median {statistics.median(ds):.2f} ms, max {max(ds):.2f} ms "
            f"(>= 10 ms in {sum(d >= 10 for d in ds) / len(ds):.0%} of samples, "
            f">= {args.tail_ms:g} ms in {sum(d >= args.tail_ms for d in ds) / len(ds):.0%}); "
            f"the first delay after {variant.first_delay_after} requests; every 5 s from the "
            f"start (ms): {' '.join(variant.trajectory)}"
        )
    a = results[adaptive.label]
    a_cut = base - a["p999"]
    fixed = [
        v for v in variants if v.label.startswith("fixed") and results[v.label]["extra"] <= budget
    ]
    if fixed:
        best = min(fixed, key=lambda v: results[v.label]["p999"])
        b = results[best.label]
        b_cut = base - b["p999"]
        verdict = "met" if a_cut >= b_cut else "MISSED"
        print(
            f"best fixed delay in hindsight (lowest p99.9 at extra load <= {budget:.1%}): "
            f"{best.label}, p99.9 {b['p999']:.2f} ms at {b['extra']:.2%} extra"
        )
        print(
            f"p99.9 cut: adaptive {a_cut:.2f} ms vs best fixed {b_cut:.2f} ms "
            f"(target: at least as large): {verdict}"
        )
        (al, ah), (bl, bh) = a["p999_95"], b["p999_95"]
        overlap = al <= bh and bl <= ah
        print(
            f"p99.9, 95% intervals from order statistics: adaptive {al:.2f}-{ah:.2f} ms, "
            f"{best.label} {bl:.2f}-{bh:.2f} ms: "
            + ("they overlap, the verdict is within sampling noise" if overlap else "apart")
        )
    else:
        print(f"no fixed delay kept its extra load <= {budget:.1%}; adaptive cut {a_cut:.2f} ms")
    verdict = "met" if a["extra"] <= budget else "MISSED"
    print(
        f"adaptive extra load {a['extra']:.2%} vs max_extra_load + 0.5% = {budget:.2%}: {verdict}"
    )
    failures = sum(v.failed for v in variants)
    worst = max(max(stalls, default=0.0), max(counts.late, default=0.0))
    if failures or worst > STALL:
        print(
            f"WARNING: a disturbed run ({failures} requests failed; an event loop ran "
            f"{worst * 1e3:.0f} ms late at worst, more than {STALL * 1e3:.0f} ms): "
            "the machine was too busy, run it again"
        )


if __name__ == "__main__":
    main()
