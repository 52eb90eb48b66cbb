"""The floor: the least a retry door can do, against the hand loop of bench_doors.py.

Run:  uv run python bench/bench_floor.py [--backend asyncio|trio] [--runner anyio|native]

``bench_doors.py`` compares sdkcore's doors with a hand-written loop that keeps no
record at all. This benchmark measures, side by side in the same rounds, *floor*
doors: loops written out in one frame that do only what RFC 0049 cannot do without,
and nothing sdkcore adds on top:

* a request object built per call (slots: idempotent, deadline, clock, retry count,
  the list of failed attempts; no argument checks, no id, no context);
* per failed attempt: one record appended (reason, effect, failure, duration; the
  RFC's ``retryAttempts``/``retryReasons`` and sdkcore's failure reports read it),
  the strategy asked (``BestEffortRetryStrategy.decide``, as every door does), the
  pure rule (``sdkcore._decision.decide``: idempotency, capping), the retry booked,
  and one native wait (``asyncio.sleep`` / ``trio.sleep``).

What a floor door leaves out and sdkcore's doors do: the backpressure count, the log
gate, ``Request.cancel()``, the retry budget hook, argument checks, the check that
``send`` returned an awaitable, freeing older tracebacks, the deadline propagated to
requests made inside ``send``. A floor is therefore *below* any door that keeps the
RFC's behaviour: a target below a floor cannot be met by any such door, however it is
written, on this interpreter.

Rows (each interleaved with the others in every round; median of the rounds):

* ``hand``: bench_doors.py's baseline (``anyio.sleep(0)`` between attempts);
* ``hand, native checkpoint``: the same with the loop's own ``sleep(0)``;
* ``floor execute`` / ``floor maybe_retry``: the call of bench_doors.py (3 retryable
  failures, then success) through a floor door; ``maybe_retry`` is a hand-wired loop
  awaiting an ``async def`` per failure, as sdkcore's ``maybe_retry`` is called;
* ``floor execute + deadline``: with a deadline armed through the cheapest scope
  of the backend (sdkcore's shared-heap ``Scope`` on asyncio, ``trio.CancelScope``
  on trio);
* ``floor happy + deadline``: one successful call with a deadline armed, printed as
  microseconds added to a bare ``await send()``.

``--runner`` chooses how the loop is started: ``anyio`` (``anyio.run``, as
bench_doors.py does) or ``native`` (``asyncio.run`` / ``trio.run``, as most
applications do). anyio's own checkpoint is cheaper under ``anyio.run`` (it finds its
backend faster), so the hand loop is cheaper there and every ratio higher.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from bench_doors import (  # the same call and loops (run from bench/)
    doors,
    failing,
    hand,
    hand_native,
)

from sdkcore import BestEffortRetryStrategy, Request, RetryableError, RetryOrchestrator, _runtime
from sdkcore._context import DEFAULT_EFFECT
from sdkcore._decision import decide

STRATEGY = BestEffortRetryStrategy(backoff=lambda attempt: 0.0)


class FloorRequest:
    """The least a retried request carries (see the module's docstring)."""

    __slots__ = ("attempts", "clock", "deadline", "history", "idempotent", "sent_at")

    def __init__(self, idempotent: bool, timeout: float | None) -> None:
        self.idempotent = idempotent
        self.clock = clock = time.monotonic
        self.deadline = math.inf if timeout is None else clock() + timeout
        self.attempts = 0
        self.history: list[list[Any]] | None = None
        self.sent_at = 0.0

    # The strategy reads it, as it reads a Request's.
    @property
    def retry_attempts(self) -> int:
        return self.attempts


def floor_step(request: FloorRequest, failure: RetryableError, now: float) -> float:
    """Record the failed attempt, ask the strategy and the rule, book the retry."""
    reason = failure.reason
    entry = [reason, DEFAULT_EFFECT[reason], failure, now - request.sent_at, None]
    if request.history is None:
        request.history = [entry]
    else:
        request.history.append(entry)
    action = STRATEGY.decide(request, reason)  # type: ignore[arg-type]
    _, delay = decide(
        reason, action, request.attempts, request.idempotent, request.deadline - now, 0, 1, None
    )
    request.attempts += 1
    entry[4] = delay
    return delay


def rows(orch: RetryOrchestrator) -> dict[str, Callable[[Any], Awaitable[object]]]:
    async def floor_execute(send: Any, seconds: float | None = None) -> object:
        rt = _runtime.current()
        request = FloorRequest(True, seconds)
        clock = request.clock
        scope = None if seconds is None else rt.Scope(rt.now() + seconds)
        try:
            while True:
                request.sent_at = clock()
                try:
                    return await send(request)
                except RetryableError as failure:
                    await rt.sleep(floor_step(request, failure, clock()))
        finally:
            if scope is not None:
                scope.exit(sys.exc_info()[1])

    async def floor_deadline(send: Any) -> object:
        return await floor_execute(send, 2.5)

    async def floor_retry(request: FloorRequest, failure: RetryableError) -> float:
        delay = floor_step(request, failure, request.clock())
        await _runtime.current().sleep(delay)
        return delay

    async def floor_wired(send: Any) -> object:
        request = FloorRequest(True, None)
        while True:
            request.sent_at = request.clock()
            try:
                return await send(request)
            except RetryableError as failure:
                await floor_retry(request, failure)

    sdk = doors(orch)
    return {
        "hand": hand,
        "hand, native checkpoint": hand_native,
        "floor maybe_retry": floor_wired,
        "sdkcore maybe_retry": sdk["maybe_retry"],
        "floor execute": floor_execute,
        "sdkcore execute": sdk["execute"],
        "floor execute + deadline": floor_deadline,
        "sdkcore execute + deadline": sdk["execute+deadline"],
    }


async def per_call(fn: Callable[[Any], Awaitable[object]], send: Any, calls: int) -> float:
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        await fn(send)
    return (time.perf_counter() - start) / calls * 1e6


async def happy_added(orch: RetryOrchestrator, calls: int, rounds: int) -> dict[str, float]:
    """Microseconds a successful call with a deadline adds to a bare ``await send()``."""
    ok = failing(0)
    rt = _runtime.current()

    async def bare() -> object:
        return await ok(None)

    async def floor() -> object:
        request = FloorRequest(True, 2.5)
        scope = rt.Scope(rt.now() + 2.5)
        request.sent_at = request.clock()
        try:
            result = await ok(request)
        except BaseException as exc:
            scope.exit(exc)
            raise
        scope.exit(None)
        return result

    async def sdk() -> object:
        return await orch.execute(Request(idempotent=True, timeout=2.5), ok)

    cases = {"bare": bare, "floor": floor, "sdkcore": sdk}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            gc.collect()
            start = time.perf_counter()
            for _ in range(calls):
                await fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    return {name: us - medians["bare"] for name, us in medians.items() if name != "bare"}


async def main_async(calls: int, rounds: int) -> None:
    orch = RetryOrchestrator(STRATEGY)
    table = rows(orch)
    sends = {name: failing(3) for name in table}
    for name, fn in table.items():  # warm up
        await per_call(fn, sends[name], calls // 10)
    samples: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(rounds):
        for name, fn in table.items():
            samples[name].append(await per_call(fn, sends[name], calls))
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians["hand"]
    for name, us in medians.items():
        print(f"  {name:27s} {us:6.2f} us  {us / base:4.2f}x hand")
    for name, added in (await happy_added(orch, calls, rounds)).items():
        print(f"  {name + ' happy + deadline':27s} adds {added:+5.2f} us to a bare await send()")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--runner", choices=["anyio", "native"], default="anyio")
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
    print(
        f"backend={args.backend} runner={args.runner} calls={args.calls} "
        f"rounds={args.rounds} (medians)"
    )
    if args.runner == "anyio":
        anyio.run(main_async, args.calls, args.rounds, backend=args.backend)
    elif args.backend == "asyncio":
        asyncio.run(main_async(args.calls, args.rounds))
    else:
        import trio

        trio.run(main_async, args.calls, args.rounds)


if __name__ == "__main__":
    main()
