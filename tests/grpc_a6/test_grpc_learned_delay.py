"""``insecure_channel(hedge_delay=...)``: a hedged method's delay learned by a LatencyQuantile.

Against a real grpc.aio server on 127.0.0.1 (rfc/0009, "On gRPC channels").
"""

from __future__ import annotations

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc_server import TEST_TIMEOUT, Server  # noqa: E402
from hedge_server import HedgeScript, hedging_config, ok  # noqa: E402

from sdkcore._latency import LatencyQuantile  # noqa: E402
from sdkcore.grpc import insecure_channel  # noqa: E402


@pytest.mark.asyncio
async def test_learned_delay(server: Server) -> None:
    q = LatencyQuantile(min_samples=20, min_delay=0)
    for _ in range(20):
        q.record(0.05)
    script = HedgeScript(server, "M", {0: ok(1.0, b"slow"), 1: ok(0.0, b"fast")})
    seen: list[str] = []

    def learned(method: str) -> LatencyQuantile:
        seen.append(method)
        return q

    async with insecure_channel(
        server.target,
        service_config=hedging_config(max_attempts=2, delay="5s"),
        hedge_delay=learned,
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            assert await ch.unary_unary(script.method)(b"x") == b"fast"
            # a second call reuses the method's plan: the function is asked once per method
            assert await ch.unary_unary(script.method)(b"x") == b"fast"
    by = script.by_index()
    # the learned 50 ms, not the service config's 5 s
    assert 0.04 <= by[1].start - by[0].start < 0.5, by[1].start - by[0].start
    assert seen == ["/test.Svc/M"]
    assert q.count >= 22  # every call fed it (the winning hedge of each)


@pytest.mark.asyncio
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
    assert script.count == 1  # before min_samples: no hedge, not even at the config's 10 ms
    assert q.count == 1


@pytest.mark.asyncio
async def test_none_keeps_the_service_configs_delay(server: Server) -> None:
    script = HedgeScript(server, "M", {0: ok(1.0, b"slow"), 1: ok(0.0, b"fast")})
    async with insecure_channel(
        server.target,
        service_config=hedging_config(max_attempts=2, delay="0.05s"),
        hedge_delay=lambda m: None,
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            assert await ch.unary_unary(script.method)(b"x") == b"fast"
    by = script.by_index()
    assert 0.04 <= by[1].start - by[0].start < 0.5, by[1].start - by[0].start


@pytest.mark.asyncio
async def test_a_wrong_answer_is_a_clear_error_and_nothing_is_sent(server: Server) -> None:
    script = HedgeScript(server, "M", {0: ok(0.0, b"ok")})
    answers: list[object] = [0.05, LatencyQuantile(min_samples=20)]
    async with insecure_channel(
        server.target,
        service_config=hedging_config(max_attempts=2, delay="0.05s"),
        hedge_delay=lambda m: answers.pop(0),  # type: ignore[arg-type,return-value]
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            with pytest.raises(TypeError, match=r"hedge_delay=.*returned 0\.05.*/test\.Svc/M"):
                await ch.unary_unary(script.method)(b"x")
            assert script.count == 0
            # not cached: the next call asks again, and runs
            assert await ch.unary_unary(script.method)(b"x") == b"ok"
    assert script.count == 1


def test_hedge_delay_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"hedge_delay=\.\.\.\) must be a callable"):
        insecure_channel("127.0.0.1:1", hedge_delay=LatencyQuantile())  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_channel_with_telemetry_reports_its_learned_delays(server: Server) -> None:
    """The channel watched its limiter and throttle but not its learned hedge delays:
    ``sdkcore.hedge.delay`` showed nothing unless the application watched each one."""
    pytest.importorskip("opentelemetry.sdk")
    from telemetry_kit import Otel

    otel = Otel()
    try:
        q = LatencyQuantile(min_samples=20, min_delay=0)
        for _ in range(20):
            q.record(0.05)
        mine = LatencyQuantile(min_samples=20, min_delay=0)
        for _ in range(20):
            mine.record(0.05)
        otel.telemetry.watch(mine, name="the application's own")
        script = HedgeScript(server, "M", {0: ok(0.0, b"ok")})
        other = HedgeScript(server, "N", {0: ok(0.0, b"ok")})
        async with insecure_channel(
            server.target,
            service_config=hedging_config(max_attempts=2, delay="5s"),
            hedge_delay=lambda m: q if m.endswith("/M") else mine,
            telemetry=otel.telemetry,
        ) as ch:
            with anyio.fail_after(TEST_TIMEOUT):
                assert await ch.unary_unary(script.method)(b"x") == b"ok"
                assert await ch.unary_unary(other.method)(b"x") == b"ok"
        points = otel.metrics()["sdkcore.hedge.delay"].points
        labels = {a["sdkcore.endpoint"] for a, _ in points}
        assert f"{server.target}/test.Svc/M" in labels
        assert "the application's own" in labels  # left with its own label
    finally:
        otel.shutdown()
