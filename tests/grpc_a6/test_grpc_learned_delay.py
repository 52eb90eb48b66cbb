from __future__ import annotations

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc_server import TEST_TIMEOUT, Server  # noqa: E402
from hedge_server import HedgeScript, hedging_config, ok  # noqa: E402

from sdkcore._latency import LatencyQuantile  # noqa: E402
from sdkcore.grpc import insecure_channel  # noqa: E402

pytestmark = pytest.mark.asyncio


async def test_learned_delay(server: Server) -> None:
    q = LatencyQuantile(min_samples=20, min_delay=0)
    for _ in range(20):
        q.record(0.05)
    script = HedgeScript(server, "M", {0: ok(1.0, b"slow"), 1: ok(0.0, b"fast")})
    seen = []
    async with insecure_channel(
        server.target,
        service_config=hedging_config(max_attempts=2, delay="5s"),
        hedge_delay=lambda m: (seen.append(m), q)[1],
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            assert await ch.unary_unary(script.method)(b"x") == b"fast"
    by = script.by_index()
    assert 0.04 <= by[1].start - by[0].start < 0.5, by[1].start - by[0].start
    assert seen == [script.method.lstrip("/")] or seen, seen
    assert q.count >= 21


async def test_cold_no_hedge_and_records(server: Server) -> None:
    q = LatencyQuantile(min_samples=20, min_delay=0)
    script = HedgeScript(server, "M", {0: ok(0.2, b"slow"), 1: ok(0.0, b"fast")})
    async with insecure_channel(
        server.target,
        service_config=hedging_config(max_attempts=2, delay="0.01s"),
        hedge_delay=lambda m: q,
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            assert await ch.unary_unary(script.method)(b"x") == b"slow"
    assert script.count == 1
    assert q.count == 1
