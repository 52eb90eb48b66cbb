"""Throughput of unary RPCs that fail once then succeed: sdkcore vs grpcio native retries.

Same loopback server, same service config, same run. Every RPC's first attempt
fails with UNAVAILABLE and its retry succeeds. Prints RPCs/s for both and the
ratio sdkcore / native (target >= 0.8).

    uv run python bench/bench_grpc.py [--rpcs 1000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

import grpc
import structlog
from grpc import aio

from sdkcore.grpc import insecure_channel

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


async def start_server() -> tuple[Any, int]:
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
    return server, port


async def run(channel: Any, prefix: str, rpcs: int, concurrency: int) -> float:
    stub = channel.unary_unary(METHOD)
    next_id = iter(range(rpcs))

    async def worker() -> None:
        for i in next_id:
            assert await stub(f"{prefix}-{i}".encode(), timeout=10) == b"ok"

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rpcs / (time.perf_counter() - start)


async def main(rpcs: int, concurrency: int, rounds: int) -> None:
    server, port = await start_server()
    target = f"127.0.0.1:{port}"
    native = aio.insecure_channel(
        target, options=[("grpc.service_config", CONFIG), ("grpc.enable_retries", 1)]
    )
    ours = insecure_channel(target, service_config=CONFIG)
    try:
        await run(native, "warm-n", 100, concurrency)
        await run(ours, "warm-s", 100, concurrency)
        best_native = best_ours = 0.0
        for r in range(rounds):
            n = await run(native, f"n{r}", rpcs, concurrency)
            s = await run(ours, f"s{r}", rpcs, concurrency)
            best_native, best_ours = max(best_native, n), max(best_ours, s)
            print(
                f"round {r + 1}: native {n:8.0f} RPC/s   sdkcore {s:8.0f} RPC/s   ratio {s / n:.2f}"
            )
        ratio = best_ours / best_native
        print(f"best:    native {best_native:8.0f} RPC/s   sdkcore {best_ours:8.0f} RPC/s")
        print(f"ratio sdkcore/native = {ratio:.2f} (target >= 0.80)")
    finally:
        await native.close()
        await ours.close()
        await server.stop(None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rpcs", type=int, default=1000, help="RPCs per client per round (max 5000)"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # An application decides what is logged; per-retry debug events are off here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    asyncio.run(main(min(args.rpcs, 5000), max(1, args.concurrency), max(1, args.rounds)))
