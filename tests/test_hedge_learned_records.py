"""What a hedged request tells its learned delay (rfc/0009, "Answered before the hedge went out").

An answer read after the delay but before the next copy went out cost no extra load: it
is recorded just under the delay, not at the latency a late loop gave it. A copy whose
hedge did go out is recorded at its own latency. And a copy booked in the same turn as
the answer that ended the chain is never sent (trio starts it anyway: it must not send).

Small real delays on asyncio and trio; the loop is stalled on purpose with ``time.sleep``
(the stall a collection or a preempted process makes). One test runs trio on a mock clock
so that the answer and the hedge come due at the same instant.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest
import trio
import trio.testing

from sdkcore import HedgePolicy, LatencyQuantile, Request, RetryOrchestrator
from sdkcore._hedge import answered_before_hedge
from sdkcore._latency import _bucket, _upper

SAFETY = 10.0


def stall(seconds: float) -> None:
    """Block the event loop, as a collection or a preempted process does (on purpose)."""
    time.sleep(seconds)


class Spy(LatencyQuantile):
    """A real LatencyQuantile that also keeps what each request recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[float, bool]] = []

    def record(self, latency: Any, *, cut: bool = False) -> None:
        self.seen.append((float(latency), cut))
        super().record(latency, cut=cut)


def warmed(latency: float, samples: int = 20) -> Spy:
    q = Spy(min_samples=samples, min_delay=0)
    for _ in range(samples):
        q.record(latency)
    q.seen.clear()
    return q


async def hedge(send: Any, policy: HedgePolicy, **kwargs: Any) -> Any:
    with anyio.fail_after(SAFETY):
        return await RetryOrchestrator().hedge(
            Request(name="get", idempotent=True, timeout=5.0), send, policy, **kwargs
        )


def test_answered_before_hedge() -> None:
    assert answered_before_hedge(0.004, 0.005) == 0.004
    under = answered_before_hedge(0.030, 0.005)
    assert under < 0.005
    assert under > 0.005 * (1 - 1e-12)
    assert answered_before_hedge(0.005, 0.005) < 0.005  # at the delay: under it too
    # A learned delay is a bucket's upper bound, which a latency equal to it would pass
    # into the next bucket: just under it stays in the delay's own, so a rank there
    # reports the same delay and the delay never creeps up.
    d = warmed(0.005).delay_seconds
    assert _bucket(d) == _bucket(d * (1 - 1e-9)) + 1
    assert _upper(_bucket(answered_before_hedge(d, d))) == d


@pytest.mark.anyio
async def test_an_answer_read_before_the_hedges_timer_counts_under_the_delay(
    anyio_backend: str,
) -> None:
    q = warmed(0.01)
    delay = q.delay_seconds
    started: list[int] = []

    async def send(request: Request, index: int) -> int:
        started.append(index)
        stall(3 * delay)  # the loop stalls past the delay; the answer is then read first
        return index

    assert await hedge(send, HedgePolicy(2, delay=q)) == 0
    assert started == [0]  # its hedge was due, and never went out
    [(latency, cut)] = q.seen
    assert not cut
    assert delay * (1 - 1e-9) < latency < delay, (latency, delay)  # not the 30 ms it took


@pytest.mark.asyncio
async def test_a_hedge_booked_but_not_begun_when_the_answer_came_counts_under_the_delay() -> None:
    # asyncio only: the stalled loop runs the answer's callback, then the hedge's timer
    # (which books hedge 1 and creates its task), then the caller, which reads the answer
    # before hedge 1's task has taken its first step.
    q = warmed(0.01)
    delay = q.delay_seconds
    started: list[int] = []

    async def send(request: Request, index: int) -> int:
        started.append(index)
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(answer.set_result, index)
        stall(3 * delay)
        return await answer

    assert await hedge(send, HedgePolicy(2, delay=q)) == 0
    assert started == [0]  # hedge 1 was booked, then cut before its task began
    [(latency, cut)] = q.seen
    assert not cut
    assert delay * (1 - 1e-9) < latency < delay, (latency, delay)


@pytest.mark.anyio
async def test_a_copy_whose_hedge_went_out_records_its_own_latency(anyio_backend: str) -> None:
    q = warmed(0.01)
    delay = q.delay_seconds

    async def send(request: Request, index: int) -> int:
        if index == 0:
            await anyio.sleep(4 * delay)
            return 0
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    assert await hedge(send, HedgePolicy(2, delay=q)) == 0
    first = [latency for latency, cut in q.seen if not cut]
    cut = [latency for latency, cut in q.seen if cut]
    assert len(first) == 1, q.seen
    assert first[0] >= 3.5 * delay  # the hedge was needed: counted at its own latency
    assert len(cut) == 1
    assert cut[0] < first[0]  # hedge 1, cut when hedge 0 won


def test_on_trio_a_hedge_booked_as_the_chain_ends_is_never_sent() -> None:
    # The answer of hedge 0 and hedge 1's due time fall on the same virtual instant: trio
    # runs the two ready tasks in either order. When the runner goes first it books hedge
    # 1 and starts its task; hedge 0 then wins in the same batch, and hedge 1's task takes
    # its first step after the chain is over. It must not call send.
    q = warmed(0.01)
    delay = q.delay_seconds
    booked = 0
    late_sends = 0

    class Throttler:
        def allows_retry(self) -> bool:  # asked once per hedge booked after the first
            nonlocal booked
            booked += 1
            return True

        def record_failure(self) -> bool:
            return False

        def record_success(self) -> None:
            pass

    async def main() -> None:
        nonlocal late_sends
        answered = False

        async def send(request: Request, index: int) -> int:
            nonlocal answered, late_sends
            if index == 0:
                await trio.sleep(delay)
                answered = True
                return 0
            if answered:
                late_sends += 1
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        for _ in range(40):
            answered = False
            result = await RetryOrchestrator().hedge(
                Request(name="get", idempotent=True, timeout=None),
                send,
                HedgePolicy(2, delay=q),
                throttler=Throttler(),
            )
            assert result == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert booked > 0  # the race happened: the path is exercised
    assert late_sends == 0
