"""Per-call overhead of sdkcore's retry path vs a hand-written retry loop.

Run:  uv run python bench/bench_core.py [--backend asyncio|trio] [--calls N]

Scenarios, each measured in the same process, interleaved, best of several rounds:

* retry3: a call that fails 3 times with a retryable error, then succeeds
  (4 attempts). sdkcore: ``RetryOrchestrator.execute`` with a
  BestEffortRetryStrategy whose backoff is 0, on an idempotent Request (timeout
  2.5 s, so the deadline scope is armed). Baseline: ``for`` + ``try/except`` +
  ``anyio.sleep(0)``.
* happy: a call that succeeds at once, same two paths.

structlog is configured with debug filtered out (INFO and above), the way a
production application runs. Prints microseconds per call and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio
import structlog

from sdkcore import BestEffortRetryStrategy, Request, RetryableError, RetryOrchestrator, RetryReason

REASON = RetryReason.KV_TEMPORARY_FAILURE


def make_send(failures: int) -> Callable[[object], Awaitable[str]]:
    state = {"n": 0}

    async def send(_: object) -> str:
        n = state["n"]
        if n < failures:
            state["n"] = n + 1
            raise RetryableError(REASON)
        state["n"] = 0
        return "ok"

    return send


async def hand_loop(send: Callable[[object], Awaitable[str]]) -> str:
    for _attempt in range(1000):
        try:
            return await send(None)
        except RetryableError:
            await anyio.sleep(0)  # noqa: ASYNC115 - the baseline the issue names
    raise RuntimeError("unreachable")


async def measure(fn: Callable[[], Awaitable[object]], calls: int) -> float:
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - start) / calls * 1e6


async def run(calls: int, rounds: int, request_timeout: float | None) -> dict[str, float]:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: 0.0))
    results: dict[str, list[float]] = {}
    for failures, label in ((3, "retry3"), (0, "happy")):
        send_sdk = make_send(failures)
        send_hand = make_send(failures)

        async def sdk(send: Callable[[object], Awaitable[str]] = send_sdk) -> str:
            return await orchestrator.execute(
                Request(idempotent=True, timeout=request_timeout), send
            )

        async def hand(send: Callable[[object], Awaitable[str]] = send_hand) -> str:
            return await hand_loop(send)

        await measure(sdk, calls // 10)  # warm up
        await measure(hand, calls // 10)
        for _ in range(rounds):
            results.setdefault(f"{label}.sdkcore", []).append(await measure(sdk, calls))
            results.setdefault(f"{label}.hand", []).append(await measure(hand, calls))
    return {k: min(v) for k, v in results.items()} | {
        k + ".median": statistics.median(v) for k, v in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
    print(f"backend={args.backend} calls={args.calls} rounds={args.rounds}")
    for timeout, title in ((2.5, "timeout=2.5s (deadline armed)"), (None, "timeout=None")):
        r = anyio.run(run, args.calls, args.rounds, timeout, backend=args.backend)
        print(f"\n{title}  (best of {args.rounds}; median in brackets), microseconds per call")
        for label, attempts in (("retry3", 4), ("happy", 1)):
            sdk, hand = r[f"{label}.sdkcore"], r[f"{label}.hand"]
            per_attempt = (sdk - hand) / attempts
            print(
                f"  {label:7s} sdkcore {sdk:7.2f} [{r[label + '.sdkcore.median']:7.2f}]  "
                f"hand {hand:7.2f} [{r[label + '.hand.median']:7.2f}]  "
                f"ratio {sdk / hand:5.2f}x  overhead/attempt {per_attempt:+6.2f} us"
            )


if __name__ == "__main__":
    main()
