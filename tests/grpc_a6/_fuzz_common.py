"""What the randomized gRPC harnesses share: test_grpc_fuzz.py, test_grpc_stream_fuzz.py and
test_grpc_telemetry_fuzz.py (a seed's ``World`` plays its plan through sdkcore's channel
against a real grpc.aio server, then checks what happened).

* bounds: ``HANG``, ``SETTLE``, ``DEADLINE_SLACK``; A6 metadata: ``PREV``, ``PUSHBACK``;
  the statuses the unary servers play: ``RETRYABLE``, ``OTHER``, ``CODE`` (test_grpc_fuzz
  and test_grpc_telemetry_fuzz; the stream harness has its own);
* the probe on grpc.aio's call class: ``ACTIVE`` (the seed running now), ``active``,
  ``probe_calls``;
* a plan's interference: ``status_delay``, ``interfere_on_status``;
* running a seed: ``attempt_metadata`` (the server's side), ``run_calls``, ``settle``,
  ``close_channel``;
* checks and reports: ``check_attempt_headers``, ``check_attempt_deadlines``,
  ``channel_problems``, ``describe_close``, ``ms``, ``name_of``, ``show``.

What is drawn from a seed's generator, and in which order, is part of every seed's plan:
the helpers here draw exactly what the harnesses drew before they were shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc.aio import _call as aio_call  # noqa: E402 - the probe (see probe_calls)

#: How long a "hang" step waits: far beyond any seed, so only a cancellation ends it.
HANG = 30.0
#: How long the server may take to see the cancellations of attempts still running when
#: their calls ended (a cancellation travels as RST_STREAM). A bound, not a wait: the check
#: ends as soon as they have. Generous: under two test runs at once one took over 0.5 s
#: (test_grpc_fuzz.py, seed 19); an attempt nobody cancelled would run for HANG.
SETTLE = 2.0
#: Slack when comparing an attempt's grpc deadline with the call's: sdkcore computes the
#: time left on its monotonic clock, grpc.aio turns it into a wall-clock deadline a moment
#: later (a pause in between, such as a garbage collection, moves it by as much), and
#: the probe reads it back on both clocks. Milliseconds, not a retry's worth.
DEADLINE_SLACK = 0.005

PREV = "grpc-previous-rpc-attempts"
PUSHBACK = "grpc-retry-pushback-ms"

#: The statuses the unary harnesses' servers fail with: those a policy may retry (or hedge
#: past), and others.
RETRYABLE = ("UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED")
OTHER = ("INVALID_ARGUMENT", "NOT_FOUND")
CODE = {name: getattr(grpc.StatusCode, name) for name in (*RETRYABLE, *OTHER)}
NUMBER = {code.value[0]: code for code in grpc.StatusCode}

# -- the probe ------------------------------------------------------------------------------

#: The seed running now: the probe reports every call grpc.aio makes to ``ACTIVE[0]``.
ACTIVE: list[Any] = []


@contextlib.contextmanager
def active(world: Any) -> Iterator[None]:
    """``world`` is the seed running now (its ``created(call)`` hears of grpc.aio's calls)."""
    ACTIVE.append(world)
    try:
        yield
    finally:
        ACTIVE.remove(world)


def _probe_init(original: Any) -> Any:
    def __init__(self: Any, cython_call: Any, metadata: Any, *args: Any, **kwargs: Any) -> None:
        original(self, cython_call, metadata, *args, **kwargs)
        if ACTIVE:
            ACTIVE[0].created(self)

    return __init__


def probe_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test: every call grpc.aio makes (``grpc.aio._call.Call``: every attempt of
    every shape) is reported to the seed running now, ``ACTIVE[0].created(call)``, once
    made. The probe keeps no reference to the calls (grpc.aio cancels a call that is
    garbage collected)."""
    monkeypatch.setattr(aio_call.Call, "__init__", _probe_init(aio_call.Call.__init__))


# -- a plan's interference --------------------------------------------------------------------


def status_delay(rng: random.Random) -> float:
    """How long after an attempt's status reached the client to interfere (trigger
    "status"): 0, the loop's next step (call_soon), before the tasks waiting for the status
    run (as any callback or task already due then); or up to 4 ms later. Never from inside
    grpc's done callbacks: the application cannot run between grpc setting an attempt's
    status and sdkcore's own done callback."""
    return rng.choice([0.0, 0.0, rng.uniform(0.0, 0.004)])


def interfere_on_status(
    call: Any, index: int, record: Any, interfere: Callable[[Any], None]
) -> None:
    """For a plan that interferes once attempt ``cancel_on``'s status reached the client:
    if ``call`` is that attempt (number ``index``), ``interfere(record)``
    ``plan.interfere_at`` seconds after its status (in the loop's next step for 0)."""
    plan = record.plan
    if plan.trigger == "status" and plan.interference != "none" and plan.cancel_on == index:
        loop = asyncio.get_running_loop()
        if plan.interfere_at:
            call.add_done_callback(lambda _: loop.call_later(plan.interfere_at, interfere, record))
        else:
            call.add_done_callback(lambda _: loop.call_soon(interfere, record))


# -- running a seed ---------------------------------------------------------------------------


def attempt_metadata(context: Any) -> tuple[dict[str, str], str | None, int]:
    """What a server handler knows of an attempt: its (string) metadata, its
    grpc-previous-rpc-attempts header and its index (0 for the first)."""
    md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
    header = md.get(PREV)
    index = int(header) if header is not None and header.isdigit() else 0
    return md, header, index


async def run_calls(
    calls: list[Coroutine[Any, Any, None]],
    closer: Coroutine[Any, Any, None] | None,
    safety: float,
    hung: Callable[[], None],
) -> None:
    """Runs a seed's calls, each in a task of its own, and the ``closer`` if the plan closes
    the channel, ``safety`` seconds at most: then ``hung()`` reports what still runs, which
    is cancelled (and given a second to end)."""
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(call) for call in calls]
    if closer is not None:
        tasks.append(loop.create_task(closer))
    _, pending = await asyncio.wait(tasks, timeout=safety)
    if pending:
        hung()
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=1.0)


async def settle(busy: Callable[[], bool], bound: float = SETTLE) -> None:
    """Polls ``busy()`` (there is no event to wait on) until it is false, ``bound`` seconds
    at most."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while busy() and loop.time() < deadline:  # noqa: ASYNC110 - no event to wait on
        await asyncio.sleep(0.005)


def stamped(close_calls: Callable[[], None], stamp: Callable[[], None]) -> Callable[[], None]:
    """The channel's ``_Controller._close_calls`` (where it stops taking attempts: at once
    for a close without a grace, at the grace's end or once sdkcore's calls are over with
    one), noting when it runs first."""

    def stamping() -> None:
        stamp()
        close_calls()

    return stamping


async def close_channel(
    channel: Any, grace: float | None = None, bound: float | None = None
) -> BaseException | None:
    """``channel.close(grace)``: what it raised (a problem of the seed), or None. Without a
    ``bound`` in this very task (``_Channel.close`` cancels the calls waiting between
    attempts before its first await); with one, through ``asyncio.wait_for``."""
    try:
        if bound is None:
            await channel.close(grace)
        else:
            await asyncio.wait_for(channel.close(grace), bound)
    except BaseException as exc:
        return exc
    return None


# -- checks and reports -----------------------------------------------------------------------


def check_attempt_headers(
    attempts: list[Any], served: list[Any], problem: Callable[[str], None]
) -> None:
    """grpc-previous-rpc-attempts absent on the first attempt and 1, 2, ... on the next
    ones, in the order the client made them (``attempts``); the server (``served``) saw
    only attempts the client made, each once."""
    headers = [a.header for a in attempts]
    wanted = [None if i == 0 else str(i) for i in range(len(attempts))]
    if headers != wanted:
        problem(f"grpc-previous-rpc-attempts of the attempts {headers}, expected {wanted}")
    created = {a.header for a in attempts}
    for seen in served:
        if seen.header not in created:
            problem(f"the server saw attempt {seen.header!r}, which the client never made")
    server_headers = [a.header for a in served]
    if len(set(server_headers)) != len(server_headers):
        problem(f"the server saw an attempt twice: {server_headers}")


def paused(pauses: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``pauses`` (the process's collections: conftest's ``gc_pauses``) within
    ``[start, end]`` on ``time.monotonic()``."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in pauses)


def slack(pauses: Sequence[tuple[float, float]], created_at: float) -> float:
    """:data:`DEADLINE_SLACK`, plus the collections in the second before an attempt was
    made: one between sdkcore's reading of the time left and grpc.aio making the call
    moves the attempt's deadline by as long (no client can pass grpc.aio an absolute
    deadline)."""
    return DEADLINE_SLACK + paused(pauses, created_at - 1.0, created_at)


def check_attempt_deadlines(
    attempts: list[Any],
    deadline_at: float | None,
    problem: Callable[[str], None],
    pauses: Sequence[tuple[float, float]] = (),
) -> None:
    """The call's deadline (``deadline_at``, monotonic) spans every attempt (A6 "Maximum
    Number of Retries"): none has a grpc deadline past it; one made after it (a stalled
    loop) has no time left at all."""
    if deadline_at is None:
        return
    for a in attempts:
        limit = max(deadline_at, a.created_at) + slack(pauses, a.created_at)
        if a.expires_at is None or a.expires_at > limit:
            late = "none" if a.expires_at is None else ms(a.expires_at - deadline_at)
            problem(f"attempt {a.index}'s own deadline is past the call's: {late}")


def channel_problems(
    waiting: int, close_error: BaseException | None, leaked: list[Any]
) -> list[str]:
    """Once a seed's calls all ended: calls left in the channel's waiting set, what closing
    the channel raised, tasks left after the close."""
    problems = []
    if waiting:
        problems.append(f"{waiting} call(s) left in the channel's waiting set")
    if close_error is not None:
        problems.append(f"closing the channel raised {close_error!r}")
    if leaked:
        problems.append(f"tasks left after the channel closed: {leaked}")
    return problems


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def describe_close(
    close_at: float | None, grace: float | None, fmt: Callable[[float], str] = ms
) -> str:
    """A plan's close of the channel (``fmt``: how the harness writes a duration)."""
    return "no close" if close_at is None else f"close at {fmt(close_at)} grace {grace}"


def name_of(code: int | None) -> str:
    """A status code's name ("in flight": none yet)."""
    if code is None:
        return "in flight"
    status = NUMBER.get(code)
    return f"code {code}" if status is None else status.name


def show(error: BaseException | None, none: str = "") -> str:
    """An error in a report (``none``: what to write for no error)."""
    if error is None:
        return none
    if isinstance(error, aio.AioRpcError):
        return f"AioRpcError({error.code().name}, {error.details()!r})"
    return f"{type(error).__name__}({str(error)[:80]})"
