"""What the randomized schedule tests share (test_doors_fuzz, test_sync_fuzz,
test_telemetry_fuzz, the memcached one), and the hedging tests' count of live tasks.

* the fake endpoint of the core harnesses: ``PlainError``; ``Step``, ``REASONS``,
  ``ALWAYS_RETRY``, ``random_failure`` and ``small_backoff`` (test_doors_fuzz and
  test_sync_fuzz);
* a seed's guards and their checks: ``random_budget`` (a ``CountingBudget``),
  ``random_breaker``, ``with_permit``, ``check_in_retry``, ``check_drained``,
  ``check_request_budget``, ``check_budget_totals``, ``expected_balance``;
  ``check_timed_out`` (a request that timed out);
* running a seed: ``through_door`` (the async doors), ``run_seed`` and ``stall`` (a task
  group on asyncio or trio, test_doors_fuzz and test_telemetry_fuzz), ``Threads`` (the
  threads of the sync harnesses), ``live_tasks`` and ``leaked_tasks``;
* reports: ``show``.

What is drawn from a seed's generator, and in which order, is part of every seed's plan:
the helpers here draw exactly what the harnesses drew before they were shared.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.abc

from sdkcore import (
    AttemptEffect,
    CancellationReason,
    CircuitBreaker,
    HedgePolicy,
    Request,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
)

T = TypeVar("T")

# -- the fake endpoint ----------------------------------------------------------------------


class PlainError(Exception):
    """A non-retryable answer of the fake endpoint: the request fails with it, unchanged."""


@dataclass
class Step:
    """One planned answer of the endpoint (the n-th send of a request; past the plan: ok)
    of test_doors_fuzz and test_sync_fuzz."""

    delay: float  # seconds the send takes (doors: after its first checkpoint; sync: blocks)
    # "ok"; "retry" (RetryableError); "plain" (PlainError); test_sync_fuzz also: "expire",
    # the send blocks for the request's time left, as a socket timeout set from
    # request.time_left, and raises the builtin TimeoutError (rfc/0001 "The three doors":
    # past the deadline, the timeout)
    kind: str = "ok"
    reason: RetryReason | None = None
    effect: AttemptEffect | None = None
    # RetryableError(retry_after=...); test_sync_fuzz also -1.0: "just before the deadline"
    # (the time left then, less up to 0.3 ms), a wait that ends a hair before the deadline
    hint: float | None = None
    reset: bool = False  # raised from a ConnectionResetError: a breaker failure


#: Reasons a send may fail with. Always-retry reasons wait RFC 0049's controlled backoff
#: (up to 1 s) whatever the strategy: only requests with a timeout get them.
REASONS = [
    RetryReason.KV_LOCKED,
    RetryReason.KV_TEMPORARY_FAILURE,  # a rejection for test_sync_fuzz's throttle
    # maybe applied; never retried for a non-idempotent one
    RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT,
    RetryReason.UNKNOWN,
    RetryReason.SOCKET_NOT_AVAILABLE,  # not sent
    # not sent by default; a rejection (test_sync_fuzz's throttle) when it was sent
    RetryReason.SERVICE_NOT_AVAILABLE,
    RetryReason.SERVICE_RESPONSE_CODE_INDICATED,
    RetryReason.AUTHENTICATION_ERROR,  # terminal: the default strategy fails fast
]
ALWAYS_RETRY = [RetryReason.KV_NOT_MY_VBUCKET, RetryReason.KV_COLLECTION_OUTDATED]


def random_failure(rng: random.Random, bounded: bool) -> tuple[RetryReason, AttemptEffect | None]:
    """A retryable failure of the endpoint: its reason (an always-retry one only for a
    ``bounded`` request, one with a timeout) and the effect it reports (None, half the
    time: the reason's default)."""
    reason = rng.choice(REASONS + ALWAYS_RETRY if bounded else REASONS)
    e = AttemptEffect
    effect = rng.choice([None, None, None, e.NOT_SENT, e.NOT_APPLIED, e.MAYBE_APPLIED])
    return reason, effect


def small_backoff(retries: int) -> float:
    """A small constant backoff for requests without a deadline (1, 2 or 3 ms)."""
    return 0.001 * (1 + retries % 3)


# -- the guards of a seed, and their checks -------------------------------------------------


class GrantingBudget:
    """A retry budget that grants every withdrawal and counts what it is given back
    (``withdrawals``, ``refunds``): every withdrawal whose retry sends nothing is refunded,
    once."""

    def __init__(self) -> None:
        self.withdrawals = self.refunds = 0

    def deposit(self) -> None:
        pass

    def try_withdraw(self) -> bool:
        self.withdrawals += 1
        return True

    def refund(self) -> None:
        self.refunds += 1


class CountingBudget:
    """A ``RetryBudget`` that counts what the orchestrator does with it, in all and per
    request: ``current()`` is the record of the request running in this task or thread
    (its ``deposits``, ``withdrawn`` and ``refunded`` are counted), or None."""

    def __init__(self, inner: RetryBudget, problems: list[str], current: Callable[[], Any]) -> None:
        self.inner = inner
        self.problems = problems
        self.current = current
        self.lock = threading.Lock()
        self.deposits = 0
        self.granted = 0
        self.refused = 0
        self.refunds = 0

    def deposit(self) -> None:
        with self.lock:
            self.deposits += 1
        record = self.current()
        if record is not None:
            record.deposits += 1
        self.inner.deposit()

    def try_withdraw(self) -> bool:
        granted = self.inner.try_withdraw()
        with self.lock:
            if granted:
                self.granted += 1
            else:
                self.refused += 1
        record = self.current()
        if granted and record is not None:
            record.withdrawn += 1
        return granted

    def refund(self) -> None:
        with self.lock:
            self.refunds += 1
            if self.refunds > self.granted:
                self.problems.append(
                    f"budget: refund #{self.refunds} with only {self.granted} withdrawals granted"
                )
        record = self.current()
        if record is not None:
            record.refunded += 1
        self.inner.refund()


def random_budget(
    rng: random.Random, problems: list[str], current: Callable[[], Any]
) -> CountingBudget | None:
    """A seed's retry budget (six seeds in ten), counted: ttl 10 s, a random reserve and
    ratio."""
    if rng.random() < 0.6:
        inner = RetryBudget(
            ttl=10,
            min_retries_per_sec=rng.choice([0, 0.2, 1, 10]),
            retry_ratio=rng.choice([0.0, 0.2, 1.0]),
        )
        return CountingBudget(inner, problems, current)
    return None


def random_breaker(rng: random.Random, chance: float) -> CircuitBreaker | None:
    """A seed's circuit breaker (``chance``: how likely): it opens after 2 to 8 outcomes of
    which half failed, for a 3 to 15 ms sleep window."""
    if rng.random() < chance:
        return CircuitBreaker(
            volume_threshold=rng.randint(2, 8),
            error_threshold_percentage=50,
            sleep_window=rng.uniform(0.003, 0.015),
            canary_timeout=0.03,
            rolling_window=1.0,
        )
    return None


async def with_permit(limiter: Any, use_acquire: bool, send: Callable[[], Awaitable[T]]) -> T:
    """``send()`` holding a permit of ``limiter``: from ``acquire()`` (it may queue) or from
    ``guard()``."""
    if use_acquire:
        async with limiter.acquire():
            return await send()
    with limiter.guard():
        return await send()


def check_in_retry(orch: RetryOrchestrator, problems: list[str]) -> None:
    """``requests_in_retry`` within ``[0, max_requests_in_retry]`` (at any moment)."""
    in_retry = orch.requests_in_retry
    if not 0 <= in_retry <= orch.max_requests_in_retry:
        problems.append(f"requests_in_retry {in_retry} outside [0, {orch.max_requests_in_retry}]")


def check_drained(orch: RetryOrchestrator, limiter: Any, problems: list[str]) -> None:
    """Once every request ended: none in retry, nothing in flight or queued at the limiter."""
    if orch.requests_in_retry != 0:
        problems.append(f"requests_in_retry is {orch.requests_in_retry} at the end")
    if limiter is not None and (limiter.in_flight != 0 or limiter.queued != 0):
        problems.append(
            f"limiter: in_flight {limiter.in_flight}, queued {limiter.queued} at the end"
        )


def check_request_budget(
    rid: int, record: Any, spending: int, attempts: int, problems: list[str], about: str, sends: str
) -> None:
    """One request's budget operations (its ``record``'s counts): withdrawals less refunds
    are its ``spending`` sends (retries, or hedges, sent after one that reached the
    server); one deposit at most, and one if it made any of its ``attempts``. ``about``
    (the request) and ``sends`` (its sends) are for the report."""
    if record.withdrawn - record.refunded != spending:
        problems.append(
            f"budget: request {rid} ({about}): {record.withdrawn} withdrawn - "
            f"{record.refunded} refunded, but {spending} spending retries sent; {sends}"
        )
    if record.deposits > 1 or (attempts and record.deposits != 1):
        problems.append(
            f"budget: request {rid} deposited {record.deposits} times for {attempts} attempts"
        )


def check_budget_totals(
    budget: CountingBudget,
    *,
    spent: int,
    dispatched: int,
    at_most: int,
    problems: list[str],
    spending: str = "retries",
    at_most_are: str = "in all",
) -> None:
    """The budget's totals over a seed: withdrawals granted less refunds are the ``spent``
    sends that spend (``spending``: what they are, for the report); a deposit per request
    that ``dispatched``, ``at_most`` (the requests ``at_most_are``); the balance Finagle's
    arithmetic gives for those operations."""
    net = budget.granted - budget.refunds
    if net != spent:
        problems.append(
            f"budget: {budget.granted} withdrawals granted - {budget.refunds} refunds = "
            f"{net}, but {spent} {spending} were sent that spend"
        )
    if not dispatched <= budget.deposits <= at_most:
        problems.append(
            f"budget: {budget.deposits} deposits for {dispatched} dispatched requests "
            f"({at_most} {at_most_are})"
        )
    wanted = expected_balance(budget.inner, budget.deposits, net)
    if budget.inner.balance != wanted:
        problems.append(
            f"budget: balance {budget.inner.balance}, expected {wanted} from "
            f"{budget.deposits} deposits and {net} net withdrawals"
        )


def check_timed_out(
    timeout: float | None, request: Request, problem: Callable[[str], None]
) -> None:
    """A request whose door raised a ``TimeoutException`` had a timeout, and is CANCELLED with
    TIMEOUT."""
    if timeout is None:
        problem("a request without a timeout timed out")
    if request.cancellation_reason is not CancellationReason.TIMEOUT:
        problem("a timeout whose request is not CANCELLED with TIMEOUT")


def expected_balance(budget: RetryBudget, deposits: int, net_withdrawn: int) -> int:
    """``RetryBudget.balance`` after these operations within one ttl (Finagle's arithmetic,
    rfc/0007 section 2: a deposit adds 1000 tokens, a withdrawal costs int(1000 / ratio),
    1 when the ratio is 0; the reserve is min_retries_per_sec * ttl * cost)."""
    ratio, minimum = budget.retry_ratio, budget.min_retries_per_sec
    if ratio == 0 and minimum == 0:
        return 0  # Finagle's Empty
    cost = int(1000 / ratio) if ratio else 1
    per_deposit = 1000 if ratio else 0
    reserve = int(minimum * budget.ttl.total_seconds() * cost)
    tokens = deposits * per_deposit - net_withdrawn * cost + reserve
    return max(0, tokens // cost)


def live_tasks() -> int:
    """Tasks alive in this event loop (asyncio) or this trio run (nothing may outlive a door)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import trio

        def count(task: Any) -> int:
            return 1 + sum(count(t) for n in task.child_nurseries for t in n.child_tasks)

        return count(trio.lowlevel.current_root_task())
    return len(asyncio.all_tasks())


def show(error: BaseException | None, width: int = 120) -> str:
    """An exception in a report: its type and the start of its message."""
    if error is None:
        return "None"
    text = str(error)
    return f"{type(error).__name__}({text[:width]}{'...' if len(text) > width else ''})"


async def leaked_tasks(
    before: Collection[asyncio.Task[Any]],
    ignore: Callable[[asyncio.Task[Any]], bool],
    settle: float = 0.3,
) -> list[asyncio.Task[Any]]:
    """Tasks of this loop not in ``before`` still pending after ``settle`` seconds (polled
    every 10 ms, returned as soon as there are none), the caller's own and those ``ignore``
    accepts left out: what grpc.aio ends in its own time after a close is not a leak."""
    loop = asyncio.get_running_loop()
    leaked: list[asyncio.Task[Any]] = []
    deadline = loop.time() + settle
    while loop.time() < deadline:
        await asyncio.sleep(0.01)
        leaked = [
            t
            for t in asyncio.all_tasks()
            if t not in before
            and not t.done()
            and t is not asyncio.current_task()
            and not ignore(t)
        ]
        if not leaked:
            break
    return leaked


# -- running a seed ---------------------------------------------------------------------------


async def through_door(
    orch: RetryOrchestrator,
    request: Request,
    door: str,
    dispatch: Callable[[int], Awaitable[T]],
    hedge: HedgePolicy | None = None,
    before_attempt: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """``request`` through one async door, ``dispatch(index)`` being its send (``index``: the
    hedge copy, 0 for the other doors): ``"execute"``; ``"hedge"`` with the policy
    ``hedge``; or ``"hand"``, the hand-wired loop as the README shows it (``attempt()``,
    ``maybe_retry()``, ``succeed()``/``fail()``: a ``PlainError`` is final), which awaits
    ``before_attempt()`` at the start of every turn."""
    if door == "execute":

        async def send(r: Request) -> T:
            return await dispatch(0)

        return await orch.execute(request, send)
    if door == "hedge":
        assert hedge is not None

        async def copy(r: Request, index: int) -> T:
            return await dispatch(index)

        return await orch.hedge(request, copy, hedge)
    assert door == "hand", door
    while True:
        if before_attempt is not None:
            await before_attempt()
        try:
            with orch.attempt(request):
                value = await dispatch(0)
        except RetryableError as exc:
            await orch.maybe_retry(request, exc.reason, cause=exc, effect=exc.effect)
            continue
        except PlainError as exc:
            raise orch.fail(request, exc) from None
        orch.succeed(request)
        return value


async def stall(at: float, seconds: float) -> None:
    """The event loop stalls ``seconds`` (a garbage collection, a slow callback), ``at``
    seconds from now: timers that fall due meanwhile fire together."""
    await anyio.sleep(at)
    time.sleep(seconds)  # noqa: ASYNC251 - blocks the event loop on purpose


async def run_seed(
    start: Callable[[anyio.abc.TaskGroup], None],
    stalls: Iterable[tuple[float, float]],
    safety: float,
) -> tuple[bool, int]:
    """Runs a seed in one task group on asyncio or trio: its ``stalls`` (``(at, seconds)``,
    see :func:`stall`), then what ``start(tg)`` starts; cancelled after ``safety`` seconds.
    Returns whether it ran out of time, and how many more tasks are alive after the group
    than before it (nothing may outlive it)."""
    before = live_tasks()
    with anyio.move_on_after(safety) as scope:
        async with anyio.create_task_group() as tg:
            for at, seconds in stalls:
                tg.start_soon(stall, at, seconds)
            start(tg)
    return scope.cancelled_caught, live_tasks() - before


class Threads:
    """The threads a sync harness starts besides its workers (a canceller...), under
    ``lock``: :meth:`start` runs ``target(*args)`` in a daemon thread through
    :meth:`guarded` (also the workers' target), which reports what it raises to
    ``problems``, never as an unhandled thread exception."""

    def __init__(self, problems: list[str], lock: threading.Lock) -> None:
        self.problems = problems
        self.lock = lock
        self.threads: list[threading.Thread] = []

    def start(self, target: Any, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=self.guarded, args=(target, *args), daemon=True)
        with self.lock:
            self.threads.append(thread)
        thread.start()
        return thread

    def guarded(self, target: Any, *args: Any) -> None:
        try:
            target(*args)
        except BaseException as exc:
            self.problems.append(f"thread {target.__name__} raised {show(exc)}")

    def started(self) -> list[threading.Thread]:
        """The threads started so far (a copy: the list grows while threads run)."""
        return list(self.threads)


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` (a limiter's gauges, say) every millisecond, at most 5 s."""
    with anyio.fail_after(5):
        while not condition():  # noqa: ASYNC110 - polls gauges no event reports
            await anyio.sleep(0.001)
