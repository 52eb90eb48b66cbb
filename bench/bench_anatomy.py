"""Where a retried call's time goes: the core's steps added one at a time.

Run:  uv run python bench/bench_anatomy.py [--backend asyncio|trio] [--calls N] [--rounds R]

The call of ``bench_doors.py`` (3 retryable failures, zero backoff, then success),
each row one step more than the row above, all interleaved in every round (median
of the rounds):

* ``hand (anyio)``: the hand-written loop of ``bench_doors.py``, ``anyio.sleep(0)``
  between attempts (the reference of every ratio);
* ``hand (native)``: the same with the event loop's own checkpoint, the one the core
  uses (``asyncio.sleep(0)`` / ``trio.sleep(0)``);
* ``+ Request``: a ``Request`` built per call;
* ``+ transitions``: the request's own bookkeeping, each attempt begun and each
  failure recorded, the success booked (``Request._begin_attempt``,
  ``_attempt_failed``, ``_succeeded``);
* ``+ strategy``: the built-in strategy asked per retry (``OrchestratorCore._ask``,
  resolved once per call);
* ``+ decide, book``: the pure rule and the booking (``OrchestratorCore._settle``:
  ``decide()``, the backpressure count, ``Request._retry_booked``);
* ``execute``: the door itself, ``RetryOrchestrator.execute`` (argument checks, the
  log gate, the testing hooks, the cancel and budget hooks, the error paths).

It reads the core's private steps, so it moves with them: it is a map for whoever
makes the core faster, not a public figure.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from bench_doors import (  # the same call and loops as bench_doors.py (run from bench/)
    REASON,
    doors,
    failing,
    hand,
    hand_native,
)

from sdkcore import (
    BestEffortRetryStrategy,
    Request,
    RetryableError,
    RetryOrchestrator,
    _runtime,
)
from sdkcore._context import AttemptEffect

EFFECT = AttemptEffect.for_reason(REASON)


def steps(orch: RetryOrchestrator) -> dict[str, Callable[[Any], Awaitable[object]]]:
    async def with_request(send: Any) -> object:
        sleep = _runtime.current().sleep
        request = Request(idempotent=True, timeout=None)
        while True:
            try:
                return await send(request)
            except RetryableError:
                await sleep(0)

    async def with_transitions(send: Any) -> object:
        sleep = _runtime.current().sleep
        request = Request(idempotent=True, timeout=None)
        clock = request.clock
        while True:
            request._begin_attempt(clock())
            try:
                result = await send(request)
            except RetryableError as failure:
                request._attempt_failed(failure.reason, EFFECT, failure, clock())
                await sleep(0)
                continue
            request._succeeded()
            return result

    async def with_strategy(send: Any) -> object:
        sleep = _runtime.current().sleep
        request = Request(idempotent=True, timeout=None)
        clock = request.clock
        strategy = decides = None
        while True:
            request._begin_attempt(clock())
            try:
                result = await send(request)
            except RetryableError as failure:
                reason = failure.reason
                request._attempt_failed(reason, EFFECT, failure, clock())
                if strategy is None:
                    strategy, decides, _ = orch._resolve(request)
                orch._ask(request, reason, strategy, decides)
                await sleep(0)
                continue
            request._succeeded()
            return result

    async def with_decide(send: Any) -> object:
        sleep = _runtime.current().sleep
        request = Request(idempotent=True, timeout=None)
        clock = request.clock
        strategy = decides = None
        while True:
            request._begin_attempt(clock())
            try:
                result = await send(request)
            except RetryableError as failure:
                reason = failure.reason
                now = clock()
                request._attempt_failed(reason, EFFECT, failure, now)
                if strategy is None:
                    strategy, decides, _ = orch._resolve(request)
                action = orch._ask(request, reason, strategy, decides)
                _, delay = orch._settle(request, reason, action, strategy, None, failure, None, now)
                try:
                    await sleep(delay)
                finally:
                    orch._leave_backoff()
                continue
            request._succeeded()
            return result

    return {
        "hand (anyio)": hand,
        "hand (native)": hand_native,
        "+ Request": with_request,
        "+ transitions": with_transitions,
        "+ strategy": with_strategy,
        "+ decide, book": with_decide,
        "execute": doors(orch)["execute"],
    }


async def per_call(fn: Callable[[Any], Awaitable[object]], send: Any, calls: int) -> float:
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        await fn(send)
    return (time.perf_counter() - start) / calls * 1e6


async def main_async(calls: int, rounds: int) -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: 0.0))
    rows = steps(orch)
    sends = {name: failing(3) for name in rows}
    for name, fn in rows.items():  # warm up
        await per_call(fn, sends[name], calls // 10)
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            samples[name].append(await per_call(fn, sends[name], calls))
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians["hand (anyio)"]
    previous = None
    for name, us in medians.items():
        step = "" if previous is None else f"  step {us - previous:+5.2f} us"
        print(f"  {name:15s} {us:6.2f} us  {us / base:4.2f}x hand (anyio){step}")
        previous = us


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
    print(f"backend={args.backend} calls={args.calls} rounds={args.rounds} (medians)")
    anyio.run(main_async, args.calls, args.rounds, backend=args.backend)


if __name__ == "__main__":
    main()
