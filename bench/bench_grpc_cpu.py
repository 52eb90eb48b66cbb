"""Client CPU per OK call: sdkcore's gRPC channels against plain grpc.aio.

The server runs in a subprocess; client and server are pinned to separate cores
(``os.sched_setaffinity``) where the box has two. Every variant runs in the same
process. Each round measures every variant beside its reference, in a shuffled
order of pairs, as reference, variant, variant, reference (half the calls each), so
that a change of the machine's speed during the four cancels out; a ratio is the
median over the rounds of those pairs' ratios. The client's CPU time
(``time.process_time``: every thread of the client process, grpc's own included)
per successful call is the median of every measurement of that variant.
``plain (control)`` is plain grpc.aio on a second channel against plain: how far a
ratio strays by noise alone.

Variants (all on one loopback server):

* ``plain``: ``grpc.aio.insecure_channel``, no service config (the reference);
* ``no policy``: ``sdkcore.grpc.insecure_channel`` without a service config
  (transparent retries only);
* ``retryPolicy`` / ``hedgingPolicy``: the method has that policy, every call is OK
  (the hedging delay is 1 s, so no hedge is ever sent);
* ``retried (grpcio)``: grpcio's built-in retries (``grpc.enable_retries`` with the
  same service config), each call's first attempt fails with UNAVAILABLE and its
  retry succeeds (the reference of ``retried (sdkcore)``);
* ``retried (sdkcore)``: the same on an sdkcore channel;
* ``retried (hand loop)``: the same on a plain grpc.aio channel, retried by a
  hand-written loop (catch, sleep 10 ms, call again): the floor of any retry made
  from Python, for reference;
* ``retried (hand, jitter)``: the same loop sleeping as A6 does (and the sdkcore
  channel does): a random wait below 10 ms (full jitter). Fixed 10 ms sleeps wake
  the concurrent calls together, in fewer turns of the loop: cheaper per call.

* ``stream ...``: a server-streaming method answering one message, read to its end,
  on plain grpc.aio, an sdkcore channel without a service config and one with the
  retryPolicy (each against ``stream plain``).

Every call also runs a second time with ``timeout=10`` (a deadline, as production
calls carry), as its own row ``... +timeout`` against ``plain +timeout``; the retried
rows with a timeout also have ``retried (interceptor)``: the same retry written as a
15-line grpc.aio ``UnaryUnaryClientInterceptor`` (:class:`HandRetry`) with the same
backoff (A6's full jitter below 10 ms), the reference of ``retried (sdkcore) +timeout``.

    uv run python bench/bench_grpc_cpu.py [--calls 1200] [--rounds 15] [--concurrency 32]
                                          [--only TEXT]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import structlog
from grpc import aio

ECHO = "/bench.Svc/Echo"
STREAM = "/bench.Svc/Stream"
FAIL_ONCE = "/bench.Svc/FailOnce"
HEDGED = "/bench.Hedged/Echo"


def _policy(service: str, kind: str) -> dict[str, Any]:
    mc: dict[str, Any] = {"name": [{"service": service}]}
    if kind == "retry":
        mc["retryPolicy"] = {
            "maxAttempts": 2,
            "initialBackoff": "0.01s",
            "maxBackoff": "0.01s",
            "backoffMultiplier": 1,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    else:
        mc["hedgingPolicy"] = {"maxAttempts": 2, "hedgingDelay": "1s"}
    return mc


CONFIG = json.dumps(
    {"methodConfig": [_policy("bench.Svc", "retry"), _policy("bench.Hedged", "hedge")]}
)
#: grpcio's own retries get the retryPolicy only (grpc C-core does not hedge).
NATIVE_CONFIG = json.dumps({"methodConfig": [_policy("bench.Svc", "retry")]})


# -- the server (a subprocess) -------------------------------------------------------
async def serve() -> None:
    seen: set[bytes] = set()

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    async def stream(request: bytes, context: Any) -> Any:
        yield request

    async def fail_once(request: bytes, context: Any) -> bytes:
        if request not in seen:
            seen.add(request)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "first attempt fails")
        seen.discard(request)
        return b"ok"

    class Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: Any) -> Any:
            if details.method in (ECHO, HEDGED):
                return grpc.unary_unary_rpc_method_handler(echo)
            if details.method == FAIL_ONCE:
                return grpc.unary_unary_rpc_method_handler(fail_once)
            if details.method == STREAM:
                return grpc.unary_stream_rpc_method_handler(stream)
            return None

    server = aio.server()
    server.add_generic_rpc_handlers((Handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed
    await server.stop(None)


def start_server(core: int | None) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "" if core is None else str(core)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


# -- the client ------------------------------------------------------------------------
class HandRetry(aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """A hand-written A6-style retry: 2 attempts on UNAVAILABLE, full jitter below 10 ms."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        deadline = None if details.timeout is None else time.monotonic() + details.timeout
        for attempt in (1, 2):
            call = await continuation(details, request)
            try:
                await call
                return call
            except aio.AioRpcError as err:
                if attempt == 2 or err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
            await asyncio.sleep(0.01 * random.random())
            if deadline is not None:  # the retry gets the call's time left
                details = details._replace(timeout=max(deadline - time.monotonic(), 0.0))
        return None  # pragma: no cover


async def run_calls(fn: Callable[[bytes], Any], calls: int, concurrency: int, tag: int) -> None:
    per_worker = calls // concurrency

    async def worker(w: int) -> None:
        for i in range(per_worker):
            await fn(b"%d:%d:%d" % (tag, w, i))

    await asyncio.gather(*(worker(w) for w in range(concurrency)))


async def measure(fn: Callable[[bytes], Any], calls: int, concurrency: int, tag: int) -> float:
    """Client CPU seconds per call."""
    t0 = time.process_time()
    await run_calls(fn, calls, concurrency, tag)
    return (time.process_time() - t0) / (calls // concurrency * concurrency)


async def client(
    port: int, calls: int, rounds: int, concurrency: int, only: str | None = None
) -> dict[str, Any]:
    from sdkcore.grpc import insecure_channel

    target = f"127.0.0.1:{port}"
    plain = aio.insecure_channel(target)
    native = aio.insecure_channel(
        target, options=[("grpc.enable_retries", 1), ("grpc.service_config", NATIVE_CONFIG)]
    )
    bare = insecure_channel(target)
    ours = insecure_channel(target, service_config=CONFIG)
    hand = aio.insecure_channel(target, interceptors=[HandRetry()])
    plain_fail = plain.unary_unary(FAIL_ONCE)

    def hand_loop(backoff: Callable[[], float]) -> Callable[[bytes], Any]:
        async def call(request: bytes) -> Any:
            try:
                return await plain_fail(request)
            except aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
            await asyncio.sleep(backoff())
            return await plain_fail(request)

        return call

    def read_all(multi_callable: Any) -> Callable[..., Any]:
        async def call(request: bytes, **kwargs: Any) -> list[bytes]:
            return [m async for m in multi_callable(request, **kwargs)]

        return call

    variants: dict[str, Callable[..., Any]] = {
        "plain": plain.unary_unary(ECHO),
        "no policy": bare.unary_unary(ECHO),
        "retryPolicy": ours.unary_unary(ECHO),
        "hedgingPolicy": ours.unary_unary(HEDGED),
        "retried (grpcio)": native.unary_unary(FAIL_ONCE),
        "retried (sdkcore)": ours.unary_unary(FAIL_ONCE),
        "retried (hand loop)": hand_loop(lambda: 0.01),
        "retried (hand, jitter)": hand_loop(lambda: 0.01 * random.random()),  # A6: full jitter
        "stream plain": read_all(plain.unary_stream(STREAM)),
        "stream no policy": read_all(bare.unary_stream(STREAM)),
        "stream retryPolicy": read_all(ours.unary_stream(STREAM)),
    }
    reference = {
        "no policy": "plain",
        "retryPolicy": "plain",
        "hedgingPolicy": "plain",
        "retried (sdkcore)": "retried (grpcio)",
        "retried (hand loop)": "retried (grpcio)",
        "retried (hand, jitter)": "retried (grpcio)",
        "stream no policy": "stream plain",
        "stream retryPolicy": "stream plain",
    }
    # Every call again with a deadline, as production calls carry one.
    for name in (
        "plain",
        "no policy",
        "retryPolicy",
        "hedgingPolicy",
        "retried (grpcio)",
        "stream plain",
        "stream no policy",
        "stream retryPolicy",
    ):
        variants[f"{name} +timeout"] = functools.partial(variants[name], timeout=10)
    variants["retried (sdkcore) +timeout"] = functools.partial(
        ours.unary_unary(FAIL_ONCE), timeout=10
    )
    variants["retried (interceptor) +timeout"] = functools.partial(
        hand.unary_unary(FAIL_ONCE), timeout=10
    )
    reference.update(
        {
            "no policy +timeout": "plain +timeout",
            "retryPolicy +timeout": "plain +timeout",
            "hedgingPolicy +timeout": "plain +timeout",
            "retried (sdkcore) +timeout": "retried (interceptor) +timeout",
            "retried (interceptor) +timeout": "retried (grpcio) +timeout",
            "stream no policy +timeout": "stream plain +timeout",
            "stream retryPolicy +timeout": "stream plain +timeout",
        }
    )
    # A control: plain grpc.aio on a second channel (its own connection, as every
    # variant's channel has) against plain: how far a ratio strays by noise alone.
    control = aio.insecure_channel(target)
    variants["plain (control)"] = control.unary_unary(ECHO)
    reference["plain (control)"] = "plain"
    variants["plain (control) +timeout"] = functools.partial(control.unary_unary(ECHO), timeout=10)
    reference["plain (control) +timeout"] = "plain +timeout"
    if only is not None:  # the rows whose name contains ``only``, and their references
        reference = {k: v for k, v in reference.items() if only in k}
        keep = set(reference) | set(reference.values())
        variants = {k: v for k, v in variants.items() if k in keep}
    for fn in variants.values():  # warm up every path
        await run_calls(fn, max(calls // 10, concurrency), concurrency, -1)
    per_call: dict[str, list[float]] = {name: [] for name in variants}
    pair_ratios: dict[str, list[float]] = {name: [] for name in reference}
    half = calls // 2
    for r in range(rounds):
        # Each variant beside its reference, in the order ref, variant, variant, ref
        # (a drift of the machine's speed within the four cancels out of the ratio).
        order = list(reference)
        random.shuffle(order)
        for name in order:
            ref = reference[name]
            a = await measure(variants[ref], half, concurrency, r)
            b = await measure(variants[name], half, concurrency, r)
            b += await measure(variants[name], half, concurrency, r)
            a += await measure(variants[ref], half, concurrency, r)
            pair_ratios[name].append(b / a)
            per_call[name].append(b / 2)
            per_call[ref].append(a / 2)
    for ch in (plain, native, bare, ours, hand, control):
        await ch.close()
    ratios = {name: statistics.median(v) for name, v in pair_ratios.items()}
    return {
        "us_per_call": {k: statistics.median(v) * 1e6 for k, v in per_call.items()},
        "ratios": ratios,
        "reference": reference,
    }


TARGETS = {
    "no policy": 1.05,
    "retryPolicy": 1.12,
    "hedgingPolicy": 1.12,
    "retried (sdkcore)": 1.25,
    "no policy +timeout": 1.05,
    "retryPolicy +timeout": 1.08,
    "retried (sdkcore) +timeout": 1.0,
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        if len(sys.argv) > 2 and sys.argv[2]:
            os.sched_setaffinity(0, {int(sys.argv[2])})
        asyncio.run(serve())
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1200, help="calls per pair and round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--only", help="only the rows whose name contains this text (and their references)"
    )
    args = parser.parse_args()
    # An application decides what is logged; per-retry debug events are off here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pinned = len(cores) >= 2
    proc, port = start_server(cores[1] if pinned else None)
    try:
        if pinned:
            os.sched_setaffinity(0, {cores[0]})
        out = asyncio.run(client(port, args.calls, args.rounds, args.concurrency, args.only))
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    where = (
        f"pinned: client core {cores[0]}, server core {cores[1]}"
        if pinned
        else "not pinned (fewer than 2 cores)"
    )
    print(
        f"client CPU per OK call, {args.calls} calls x {args.rounds} rounds, "
        f"concurrency {args.concurrency}, {where}"
    )
    for name, us in out["us_per_call"].items():
        line = f"  {name:<30} {us:8.1f} us"
        if name in out["ratios"]:
            ratio = out["ratios"][name]
            line += f"   {ratio:.3f}x {out['reference'][name]}"
            target = TARGETS.get(name)
            if target is not None:
                verdict = "meets" if ratio <= target else "MISSES"
                line += f"  (target <= {target:.2f}x: {verdict})"
            else:
                line += "  (reference only)"
        print(line)


if __name__ == "__main__":
    main()
