"""Retry statistics exported as OpenTelemetry metrics (optional extra)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk.metrics")
grpc = pytest.importorskip("grpc")
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402

from sdkcore.grpc import RetryStats, insecure_channel  # noqa: E402


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], int]]]:
    out: dict[str, list[tuple[dict[str, Any], int]]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = [
                    (dict(p.attributes or {}), p.value) for p in metric.data.data_points
                ]
    return out


@pytest.mark.asyncio
async def test_retry_metrics_exported(server: Server) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt <= 2:
            await abort(context, grpc.StatusCode.ABORTED)
        return b"ok"

    method = server.unary_unary("M", fn)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    stats = RetryStats()
    stats.export_to_opentelemetry(provider.get_meter("test"))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), stats=stats
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    got = points(reader)
    attempts = sorted((p["grpc.retry.bucket"], v) for p, v in got["grpc.client.retry.attempts"])
    assert attempts == [(">=1", 1), (">=2", 1)]
    assert got["grpc.client.retry.failed_attempts"] == [({"grpc.method": method}, 1)]
    provider.shutdown()
