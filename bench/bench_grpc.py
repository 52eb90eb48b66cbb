"""Client CPU per RPC that fails once then succeeds: sdkcore vs grpcio's native retries.

One loopback grpc.aio server, run in its own process; the same service config on a
native-retry grpc.aio channel and on ``sdkcore.grpc.insecure_channel``. Every RPC's
first attempt fails with UNAVAILABLE and its retry succeeds.

The figure is the client's CPU time per RPC (``time.process_time()``: every thread of
the client process, grpc's own included), not the wall-clock rate: the machine may be
shared, and the server's work is not the client's. Where the box has two CPUs or more,
the client and the server are pinned to separate ones (``os.sched_setaffinity``).
Prints both, and the ratio native / sdkcore (1.0: sdkcore costs what native retries
cost; 0.5: twice as much) against the 0.80 goal, saying whether it was met (this
release misses it; see bench/README.md).

    uv run python bench/bench_grpc.py [--rpcs 1000] [--concurrency 32] [--rounds 5]
"""

from __future__ import annotations

import os

# grpc core logs at INFO unless told otherwise, and reads this once, at import.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc
import structlog
from grpc import aio

from sdkcore.grpc import insecure_channel

#: The goal for the ratio native / sdkcore of client CPU per RPC. Not met by this release
#: (0.56 to 0.63 measured, bench/README.md): the run says so.
TARGET = 0.80

METHOD = "/bench.Svc/FailOnce"
CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "bench.Svc"}],
                "retryPolicy": {
                    "maxAttempts": 2,
                    "initialBackoff": "0.01s",
                    "maxBackoff": "0.01s",
                    "backoffMultiplier": 1,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


# -- the server (its own process) -----------------------------------------------------------


async def serve() -> None:
    """Serve until stdin closes; the port goes to stdout first."""
    seen: set[bytes] = set()

    async def fail_once(request: bytes, context: Any) -> bytes:
        if request not in seen:
            seen.add(request)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "first attempt fails")
        seen.discard(request)
        return b"ok"

    class Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: Any) -> Any:
            if details.method == METHOD:
                return grpc.unary_unary_rpc_method_handler(fail_once)
            return None

    server = aio.server()
    server.add_generic_rpc_handlers((Handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.read)  # the client closes our stdin when it is done
    await server.stop(None)


def cpus() -> tuple[int, int] | None:
    """(client CPU, server CPU) when the box allows pinning them apart, else None."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return None
    allowed = sorted(getaffinity(0))
    return (allowed[0], allowed[1]) if len(allowed) >= 2 else None


def pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def start_server(cpu: int | None) -> tuple[subprocess.Popen[str], int]:
    args = [sys.executable, __file__, "--serve"]
    if cpu is not None:
        args += ["--cpu", str(cpu)]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, port


# -- the client ------------------------------------------------------------------------------


async def run(channel: Any, prefix: str, rpcs: int, concurrency: int) -> tuple[float, float]:
    """(client CPU seconds per RPC, RPCs per wall-clock second) for ``rpcs`` RPCs."""
    stub = channel.unary_unary(METHOD)
    next_id = iter(range(rpcs))

    async def worker() -> None:
        for i in next_id:
            assert await stub(f"{prefix}-{i}".encode(), timeout=10) == b"ok"

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu / rpcs, rpcs / wall


async def main(rpcs: int, concurrency: int, rounds: int) -> None:
    placement = cpus()
    pin(placement[0] if placement else None)
    proc, port = start_server(placement[1] if placement else None)
    where = (
        f"client on CPU {placement[0]}, server process on CPU {placement[1]}"
        if placement
        else "not pinned (fewer than 2 CPUs available)"
    )
    print(f"{rpcs} RPCs per round, concurrency {concurrency}; {where}")
    target = f"127.0.0.1:{port}"
    native = aio.insecure_channel(
        target, options=[("grpc.service_config", CONFIG), ("grpc.enable_retries", 1)]
    )
    ours = insecure_channel(target, service_config=CONFIG)
    cpu_native: list[float] = []
    cpu_ours: list[float] = []
    try:
        await run(native, "warm-n", 200, concurrency)
        await run(ours, "warm-s", 200, concurrency)
        for r in range(rounds):
            # alternate which goes first, so neither always runs on a warmer process
            if r % 2 == 0:
                n, n_rate = await run(native, f"n{r}", rpcs, concurrency)
                s, s_rate = await run(ours, f"s{r}", rpcs, concurrency)
            else:
                s, s_rate = await run(ours, f"s{r}", rpcs, concurrency)
                n, n_rate = await run(native, f"n{r}", rpcs, concurrency)
            cpu_native.append(n)
            cpu_ours.append(s)
            print(
                f"round {r + 1}: CPU/RPC native {n * 1e6:6.0f} us  sdkcore {s * 1e6:6.0f} us  "
                f"ratio {n / s:.2f}   ({n_rate:5.0f} vs {s_rate:5.0f} RPC/s)"
            )
        n, s = statistics.median(cpu_native), statistics.median(cpu_ours)
        print(f"median:  CPU/RPC native {n * 1e6:6.0f} us  sdkcore {s * 1e6:6.0f} us")
        verdict = "met" if n / s >= TARGET else "MISSED: see bench/README.md"
        print(f"ratio native/sdkcore CPU per RPC = {n / s:.2f} (target >= {TARGET:.2f}: {verdict})")
    finally:
        await native.close()
        await ours.close()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rpcs", type=int, default=1000, help="RPCs per client per round (max 5000)"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        pin(args.cpu)
        asyncio.run(serve())
        sys.exit(0)
    # An application decides what is logged; per-retry debug events are off here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    asyncio.run(main(min(args.rpcs, 5000), max(1, args.concurrency), max(1, args.rounds)))
