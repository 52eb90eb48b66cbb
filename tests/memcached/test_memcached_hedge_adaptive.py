"""Adaptive hedging on a real memcached behind a long-tail fault proxy.

The proxy holds every GET frame 2 ms, and every 40th one 250 ms (a 2.5% tail);
a hedged copy is a GET frame of its own. ``RetryOrchestrator.hedge`` with
``HedgePolicy(delay=LatencyQuantile(0.05))`` sends no hedge until the quantile has
``min_samples`` latencies, then learns a delay between the body and the tail, and its
hedges rescue tail requests at a bounded cost. One request at a time, so the
window fills at a known pace and a copy cut because the other won has nothing else
in flight beside it. Qualitative assertions only: no latency is compared with a time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import HedgePolicy, LatencyQuantile, Request, RetryOrchestrator
from sdkcore.examples.memcached import MemcachedClient
from sdkcore.examples.memcached import _protocol as proto
from sdkcore.mapping import KvOpcode, kv_request

pytestmark = pytest.mark.anyio

BODY = 0.002  # seconds every GET frame is held
TAIL = 0.25  # seconds every TAIL_EVERY-th GET frame is held instead
TAIL_EVERY = 40
REQUESTS = 500
MIN_SAMPLES = 100


class LongTail:
    """The proxy's ``request_latency``: GET frames held BODY, every TAIL_EVERY-th TAIL."""

    def __init__(self) -> None:
        self.gets = 0
        self.lock = threading.Lock()

    def __call__(self, frame: bytes) -> float:
        if frame[1] != KvOpcode.GET:
            return 0.0
        with self.lock:
            self.gets += 1
            slow = self.gets % TAIL_EVERY == 0
        return TAIL if slow else BODY


@dataclass
class Outcome:
    delay_at_start: float | None  # the learned delay (s) when the request began
    copies: int  # copies handed to the client's send
    winner: int  # the copy that answered


async def test_the_learned_delay_sits_between_body_and_tail_and_hedges_stay_bounded(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    learned = LatencyQuantile(0.05, min_samples=MIN_SAMPLES)
    policy = HedgePolicy(max_attempts=2, delay=learned)
    orchestrator = RetryOrchestrator()
    outcomes: list[Outcome] = []
    async with MemcachedClient(f"127.0.0.1:{proxy.port}", timeout=5.0) as client:
        await client.set("k", b"v")
        proxy.request_latency = LongTail()
        proxy.reset_counts()
        endpoint = client._endpoints[0]  # the example client's per-server send: one GET a copy

        async def one() -> None:
            copies = 0
            winner: list[int] = []

            async def send(request: Request, index: int) -> bytes:
                nonlocal copies
                copies += 1
                response = await endpoint.send(
                    request, KvOpcode.GET, lambda opaque: proto.get_frame(opaque, "k")
                )
                winner.append(index)
                return response.value

            delay = learned.current_delay  # what the hedge reads as it begins
            value = await orchestrator.hedge(kv_request(KvOpcode.GET, timeout=5.0), send, policy)
            assert value == b"v"
            outcomes.append(
                Outcome(None if delay is None else delay.total_seconds(), copies, winner[0])
            )

        assert learned.current_delay is None
        for _ in range(REQUESTS):
            await one()
        _, _, frames = proxy.counts()

    # No hedge before min_samples: a request sent without a hedge records one latency, so
    # exactly the first min_samples requests began without a delay, and sent one copy each.
    cold = [o for o in outcomes if o.delay_at_start is None]
    assert cold == outcomes[:MIN_SAMPLES]
    assert all(o.copies == 1 for o in cold)
    # After min_samples the delay is set, above the body's hold and below the tail's.
    delay = learned.current_delay
    assert delay is not None
    assert BODY <= delay.total_seconds() < TAIL
    warm = [o for o in outcomes if o.delay_at_start is not None]
    assert warm
    assert all(BODY <= o.delay_at_start < TAIL for o in warm if o.delay_at_start is not None)
    # Hedges happen, and rescue tail requests: some request was answered by its hedge.
    assert sum(o.copies - 1 for o in outcomes) > 0
    assert any(o.winner == 1 for o in outcomes)
    # Each copy is a GET of its own on the wire, and the extra ones stay bounded
    # (generously: max_extra_load is 5%, the tail alone 2.5%).
    gets = frames.get(int(KvOpcode.GET), 0)
    assert gets > REQUESTS
    assert (gets - REQUESTS) / REQUESTS <= 0.25
