"""The parts of a service config that are not about retries reach grpc C-core (rfc/0003,
"What grpc C-core still applies"): load balancing and message size limits work on an
sdkcore channel as on a plain grpc.aio one. Before, an sdkcore channel dropped them
silently: every call went to one backend, and no size limit was enforced."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from grpc_server import TEST_TIMEOUT, Server, config_json

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402

from sdkcore.grpc import ServiceConfig, insecure_channel  # noqa: E402


async def _name(request: bytes, context: Any, attempt: int) -> bytes:
    return b"x" * 100


def _retry_and_sizes(**sizes: int) -> dict[str, Any]:
    return {
        "name": [{"service": "test.Svc"}],
        "retryPolicy": {
            "maxAttempts": 3,
            "initialBackoff": "0.01s",
            "maxBackoff": "0.05s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
        **sizes,
    }


def test_for_grpc_keeps_only_what_grpc_applies() -> None:
    config = ServiceConfig.from_json(
        {
            "loadBalancingConfig": [{"round_robin": {}}],
            "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
            "methodConfig": [
                {**_retry_and_sizes(maxResponseMessageBytes=10), "timeout": "1s"},
                {"name": [{"service": "other.Svc"}], "waitForReady": True},
            ],
        }
    )
    assert config.for_grpc is not None
    assert json.loads(config.for_grpc) == {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{"name": [{"service": "test.Svc"}], "maxResponseMessageBytes": 10}],
    }
    assert ServiceConfig.from_json({"methodConfig": [_retry_and_sizes()]}).for_grpc is None


@pytest.mark.asyncio
async def test_round_robin_reaches_both_backends() -> None:
    one, two = Server(), Server()
    method = one.unary_unary("Name", _name)
    two.unary_unary("Name", _name)
    await asyncio.wait_for(one.start(), TEST_TIMEOUT)
    await asyncio.wait_for(two.start(), TEST_TIMEOUT)
    try:
        target = f"ipv4:127.0.0.1:{one.port},127.0.0.1:{two.port}"
        config = {
            "loadBalancingConfig": [{"round_robin": {}}],
            "methodConfig": [_retry_and_sizes()],
        }
        async with insecure_channel(target, service_config=config) as channel:
            call = channel.unary_unary(method)
            for _ in range(20):
                await asyncio.wait_for(call(b"n"), TEST_TIMEOUT)
        assert one.count("Name") > 0
        assert two.count("Name") > 0
        assert one.count("Name") + two.count("Name") == 20
    finally:
        await asyncio.wait_for(one.stop(), TEST_TIMEOUT)
        await asyncio.wait_for(two.stop(), TEST_TIMEOUT)


@pytest.mark.asyncio
async def test_a_response_size_limit_is_enforced_as_by_grpc(server: Server) -> None:
    method = server.unary_unary("Name", _name)
    config = config_json(
        _retry_and_sizes(maxResponseMessageBytes=10), timeout=None, throttling=None
    )
    results: dict[str, Any] = {}
    async with (
        aio.insecure_channel(
            server.target, options=[("grpc.service_config", config), ("grpc.enable_retries", 1)]
        ) as native,
        insecure_channel(server.target, service_config=config) as ours,
    ):
        for label, channel in (("native", native), ("sdkcore", ours)):
            with pytest.raises(aio.AioRpcError) as info:
                await asyncio.wait_for(channel.unary_unary(method)(b"n"), TEST_TIMEOUT)
            results[label] = info.value.code()
    assert results == {
        "native": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "sdkcore": grpc.StatusCode.RESOURCE_EXHAUSTED,
    }


def test_null_fields_are_unset_and_a_zero_timeout_is_none_as_grpc_reads_them() -> None:
    config = ServiceConfig.from_json(
        {
            "methodConfig": [
                {"name": [{"service": "a.B"}], "retryPolicy": None, "timeout": "0s"},
            ],
            "retryThrottling": None,
        }
    )
    (method,) = config.method_configs
    assert method.retry_policy is None
    assert method.timeout is None
    assert config.retry_throttling is None
