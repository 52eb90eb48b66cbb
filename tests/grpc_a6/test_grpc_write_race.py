"""A request-streaming attempt the server ends while grpc.aio writes one of its messages.

grpc.aio then puts a stand-in status on the call, INTERNAL "Internal error from Core",
which races the server's own (sdkcore/grpc/_peer_status.py): before sdkcore kept the
server's status, such an attempt's UNAVAILABLE was not retried and reached the
application as INTERNAL, the channel's throttle counted a RESOURCE_EXHAUSTED as an
accept, a call the application had its OK answer from could be accounted, and read by
``code()``, as INTERNAL, and a stream's answer still in core was lost. The race is
provoked with short calls whose request iterators yield at varied moments, until it has
happened ``RACES`` times (grpc.aio logs each failed write at debug level; 6-20% of
calls, beside CPU-bound processes too), at most ``MAX_CALLS`` calls; each call is checked.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
from grpc import aio  # noqa: E402
from grpc_server import (  # noqa: E402
    TEST_TIMEOUT,
    Server,
    abort,
    pass_through,
    retry_config,
    wait_until,
)
from telemetry_kit import Otel  # noqa: E402

from sdkcore import AdaptiveThrottle, ConcurrencyLimiter  # noqa: E402
from sdkcore.grpc import _peer_status, insecure_channel  # noqa: E402

pytestmark = pytest.mark.asyncio

SHAPES = ["stream_unary", "stream_stream"]
RACES = 12
MAX_CALLS = 3000
#: A slow reader's calls take ~10 ms: fewer races are asked of them.
SLOW_RACES = 4
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
STAND_IN = (grpc.StatusCode.INTERNAL, "Internal error from Core")


def method(server: Server, shape: str, code: Any, *, retried_answers: bool) -> str:
    """A method whose attempts end ``code`` at once (OK: answer ``b"ok"`` with trailing
    metadata ``k: v``), without reading their messages; with ``retried_answers``, a
    retried attempt (A6's previous-attempts header) reads them and answers ``b"ok"``."""

    async def answer(requests: AsyncIterator[bytes], context: Any) -> bool:
        md = dict(context.invocation_metadata())
        if retried_answers and "grpc-previous-rpc-attempts" in md:
            async for _ in requests:
                pass
            return True
        if code is grpc.StatusCode.OK:
            context.set_trailing_metadata((("k", "v"),))
            return True
        await abort(context, code)
        return False

    if shape == "stream_unary":

        async def su(requests: AsyncIterator[bytes], context: Any, n: int) -> bytes:
            await answer(requests, context)
            return b"ok"

        return server.stream_unary(shape, su)

    async def ss(requests: AsyncIterator[bytes], context: Any, n: int) -> AsyncIterator[bytes]:
        if await answer(requests, context):
            yield b"ok"

    return server.stream_stream(shape, ss)


def expected(shape: str) -> Any:
    return b"ok" if shape == "stream_unary" else [b"ok"]


def one_message_at_a_varied_moment(rng: random.Random) -> AsyncIterator[bytes]:
    """A request iterator whose only message comes after 0-3 loop steps and maybe a nap."""
    spins, nap = rng.randrange(4), rng.random() * 0.0006 if rng.random() < 0.5 else 0.0

    async def requests() -> AsyncIterator[bytes]:
        for _ in range(spins):
            await anyio.lowlevel.checkpoint()
        if nap:
            await anyio.sleep(nap)
        yield b"q"

    return requests()


async def call(channel: Any, shape: str, name: str, rng: random.Random) -> tuple[Any, Any]:
    """(the call object, its answer or the AioRpcError it raised) of one call whose only
    message is written at a varied moment."""
    made = getattr(channel, shape)(name)(one_message_at_a_varied_moment(rng))
    try:
        if shape == "stream_unary":
            return made, await made
        return made, [m async for m in made]
    except aio.AioRpcError as err:
        return made, err


#: No application interceptor, and pass-through ones (before each attempt was read through
#: the call they made, grpc.aio's stand-in reached the application and the throttle).
INTERCEPTORS = pytest.mark.parametrize("interceptors", [[], pass_through()], ids=["", "icp"])


class Races:
    """Counts grpc.aio's failed writes (its debug log) and runs calls until enough."""

    def __init__(self, caplog: pytest.LogCaptureFixture, *, wanted: int = RACES) -> None:
        caplog.set_level(logging.DEBUG, logger="grpc.aio._call")
        self.caplog = caplog
        self.wanted = wanted
        self.calls = 0

    @property
    def seen(self) -> int:
        return sum('Failed "execute_batch"' in r.getMessage() for r in self.caplog.records)

    async def run(self, one: Callable[[], Awaitable[None]]) -> None:
        with anyio.fail_after(TEST_TIMEOUT * 4):
            while self.seen < self.wanted and self.calls < MAX_CALLS:
                self.calls += 1
                await one()
        assert self.seen >= 1, f"the race never happened in {self.calls} calls"


@INTERCEPTORS
@pytest.mark.parametrize("shape", SHAPES)
async def test_an_unavailable_attempt_is_retried_though_grpc_aio_failed_its_write(
    server: Server, shape: str, caplog: pytest.LogCaptureFixture, interceptors: list[Any]
) -> None:
    name = method(server, shape, UNAVAILABLE, retried_answers=True)
    limiter = ConcurrencyLimiter(4, name="svc-limit")
    rng = random.Random(7)
    races = Races(caplog)
    config = retry_config(max_attempts=2, initial="0.0001s", maximum="0.0001s")
    async with insecure_channel(
        server.target, service_config=config, limiter=limiter, interceptors=interceptors
    ) as ch:

        async def one() -> None:
            _, answer = await call(ch, shape, name, rng)
            assert answer == expected(shape)

        await races.run(one)
        await wait_until(lambda: limiter.in_flight == 0)
    assert server.count(shape) == 2 * races.calls  # every call: the UNAVAILABLE, its retry


@INTERCEPTORS
@pytest.mark.parametrize("shape", SHAPES)
async def test_the_application_and_the_throttle_see_the_servers_status_not_the_stand_in(
    server: Server, shape: str, caplog: pytest.LogCaptureFixture, interceptors: list[Any]
) -> None:
    name = method(server, shape, RESOURCE_EXHAUSTED, retried_answers=False)
    # random() 1.0: never below the rejection probability, nothing is refused locally
    throttle = AdaptiveThrottle(random=lambda: 1.0, name="svc-throttle")
    rng = random.Random(11)
    races = Races(caplog)
    async with insecure_channel(server.target, throttle=throttle, interceptors=interceptors) as ch:

        async def one() -> None:
            made, err = await call(ch, shape, name, rng)
            assert isinstance(err, aio.AioRpcError), err
            assert err.code() is RESOURCE_EXHAUSTED, err.debug_error_string()
            assert await made.code() is RESOURCE_EXHAUSTED

        await races.run(one)
        await wait_until(lambda: throttle.requests == races.calls)
    assert throttle.accepts == 0  # every attempt a rejection, none counted as an answer


@pytest.mark.parametrize("shape", SHAPES)
async def test_an_ok_the_server_sent_is_what_an_answered_call_reads_and_accounts(
    server: Server, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The server answers OK at once without reading the message. A call the application
    # got its answer from reads OK, the server's trailing metadata and details, and is
    # accounted OK, though grpc.aio's stand-in may overwrite the status afterwards. A
    # stream's answer is never lost: sdkcore reads on past the stand-in (grpc.aio's own
    # read() and async for lose some). A client-streaming call whose await failed on the
    # stand-in has lost its answer in grpc.aio: it raises the stand-in (never an error of
    # status OK) and reads it; it is accounted by the server's OK where that came.
    name = method(server, shape, grpc.StatusCode.OK, retried_answers=False)
    throttle = AdaptiveThrottle(name="svc-throttle")
    otel = Otel()
    rng = random.Random(13)
    races = Races(caplog)
    answered = lost = 0

    def recorded() -> Counter[str]:
        durations = otel.metrics().get("grpc.client.call.duration")
        if durations is None:
            return Counter()
        return Counter({a["grpc.status"]: n for a, (n, _) in durations.points})

    try:
        async with insecure_channel(
            server.target, throttle=throttle, telemetry=otel.telemetry
        ) as ch:

            async def one() -> None:
                nonlocal answered, lost
                before = recorded()
                made, answer = await call(ch, shape, name, rng)
                await wait_until(lambda: recorded().total() == races.calls)
                accounted = recorded() - before
                if isinstance(answer, aio.AioRpcError):
                    lost += 1
                    assert shape == "stream_unary", answer  # a stream reads on past it
                    assert (answer.code(), answer.details()) == STAND_IN
                    assert (await made.code(), await made.details()) == STAND_IN
                    assert accounted in (Counter(OK=1), Counter(INTERNAL=1))
                    return
                assert answer == expected(shape)
                answered += 1
                assert accounted == Counter(OK=1)
                assert await made.code() is grpc.StatusCode.OK
                assert await made.details() != STAND_IN[1]
                assert (await made.trailing_metadata()).get("k") == "v"

            await races.run(one)
            await wait_until(lambda: throttle.requests == races.calls)
        assert throttle.accepts == races.calls  # the server's OK, or no status: an accept
        assert answered >= races.calls // 2
    finally:
        otel.shutdown()


@pytest.mark.parametrize("code", [grpc.StatusCode.OK, RESOURCE_EXHAUSTED])
async def test_a_slow_reader_gets_every_message_then_the_servers_status(
    server: Server, code: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server sends three messages, then its status, without reading. Core gives the
    # client that status only once the messages are read: a reader slower than sdkcore's
    # wait for it (shortened here to ~2 ms) still ends with the server's status, not the
    # stand-in, and the call's code() says it.
    monkeypatch.setattr(_peer_status, "_WAITS", (0.0, 0.0, 0.002))

    async def ss(requests: AsyncIterator[bytes], context: Any, n: int) -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"m%d" % i
        if code is not grpc.StatusCode.OK:
            await abort(context, code)

    name = server.stream_stream("slow", ss)
    rng = random.Random(17)
    races = Races(caplog, wanted=SLOW_RACES)
    async with insecure_channel(server.target) as ch:

        async def one() -> None:
            made = ch.stream_stream(name)(one_message_at_a_varied_moment(rng))
            got: list[bytes] = []
            ended: Any = None
            try:
                while (message := await made.read()) is not aio.EOF:
                    got.append(message)
                    if len(got) == 1:  # past the shortened wait, before reading on
                        await anyio.sleep(0.01)
                ended = grpc.StatusCode.OK
            except aio.AioRpcError as err:
                ended = err.code()
            assert (got, ended) == ([b"m0", b"m1", b"m2"], code)
            assert await made.code() is code

        await races.run(one)
