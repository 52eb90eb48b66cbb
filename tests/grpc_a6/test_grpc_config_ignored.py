"""``grpc.config_ignored``: a channel made with a service config whose keys nothing
applies (A6 ignores unknown keys) says so once, in a warning, with what
``sdkcore check-config`` says of the same file (rfc/0003, "Config events").

Channel creation does not connect: no server is needed."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

import sdkcore.grpc  # noqa: E402
from sdkcore import _log  # noqa: E402
from sdkcore._check_config import lint  # noqa: E402
from sdkcore.grpc import RetryController, ServiceConfig  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio

TARGET = "127.0.0.1:1"
#: The review's config: retryPolicy misspelt, so the method is never retried.
TYPO = '{"methodConfig":[{"name":[{"service":"a"}],"retryPolicyy":{"maxAttempts":3}}]}'
TYPO_EVENT = {
    "event": "grpc.config_ignored",
    "log_level": "warning",
    "target": TARGET,
    "ignored": [
        {"path": "methodConfig[0].retryPolicyy", "suggestion": "retryPolicy", "why": "unknown key"}
    ],
    "count": 1,
}
RETRY = {
    "maxAttempts": 3,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


async def _insecure(config: Any) -> None:
    channel = sdkcore.grpc.insecure_channel(TARGET, service_config=config)
    await channel.close()


async def _secure(config: Any) -> None:
    credentials = grpc.ssl_channel_credentials()
    channel = sdkcore.grpc.secure_channel(TARGET, credentials, service_config=config)
    await channel.close()


async def _by_hand(config: Any) -> None:
    """A channel built with a RetryController's interceptors (the other door to a config)."""
    controller = RetryController(TARGET, config)
    channel = grpc.aio.insecure_channel(
        TARGET,
        options=controller.channel_options(),
        interceptors=controller.interceptors(),
    )
    controller.bind_channel(channel)
    await channel.close()


MAKERS: dict[str, Callable[[Any], Any]] = {
    "insecure_channel": _insecure,
    "secure_channel": _secure,
    "RetryController": _by_hand,
}


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
async def test_a_typo_that_disables_retries_is_one_warning(make: Callable[[Any], Any]) -> None:
    with capture_retry_events() as events:
        await make(TYPO)
    assert events == [TYPO_EVENT]  # one event, nothing else


@pytest.mark.parametrize(
    "form",
    [
        TYPO,
        TYPO.encode(),
        json.loads(TYPO),
        ServiceConfig.from_json(TYPO),  # parsed before: the ignored keys go with it
    ],
    ids=["str", "bytes", "mapping", "ServiceConfig"],
)
async def test_every_form_of_the_config_is_checked(form: Any) -> None:
    with capture_retry_events() as events:
        await _insecure(form)
    assert events == [TYPO_EVENT]


async def test_a_clean_config_logs_nothing() -> None:
    config = {
        "methodConfig": [{"name": [{"service": "a"}], "retryPolicy": RETRY, "timeout": "1s"}],
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
        "loadBalancingConfig": [{"round_robin": {}}],  # valid: grpc C-core applies it
    }
    with capture_retry_events() as events:
        await _insecure(config)
        await _insecure(None)
    assert events == []


async def test_every_ignored_key_with_its_path_and_suggestion_as_check_config_says() -> None:
    """The channel's event lists what ``check-config`` warns of as ignored (the same
    walk; each object's keys in file order, the root's first): close matches, the
    camelCase of a snake_case key, no guess, and perAttemptRecvTimeout (valid in gRPC,
    not applied by sdkcore's channels)."""
    config: dict[str, Any] = {
        "methodConfig": [
            {
                "name": [{"service": "a", "methd": "Get"}],
                "retryPolicy": {**RETRY, "max_attempts": 9, "perAttemptRecvTimeout": "1s"},
            },
            {"name": [{"service": "b"}], "hedgingPolicy": {"maxAttempts": 2, "zzz": 1}},
        ],
        "retry_throttling": {"maxTokens": 10, "tokenRatio": 0.1},
    }
    with capture_retry_events() as events:
        await _insecure(config)
    [event] = events
    assert event["ignored"] == [
        {"path": "retry_throttling", "suggestion": "retryThrottling", "why": "unknown key"},
        {"path": "methodConfig[0].name[0].methd", "suggestion": "method", "why": "unknown key"},
        {
            "path": "methodConfig[0].retryPolicy.max_attempts",
            "suggestion": "maxAttempts",
            "why": "unknown key",
        },
        {
            "path": "methodConfig[0].retryPolicy.perAttemptRecvTimeout",
            "suggestion": None,
            "why": "not supported by sdkcore channels",
        },
        {"path": "methodConfig[1].hedgingPolicy.zzz", "suggestion": None, "why": "unknown key"},
    ]
    assert event["count"] == 5
    said = {w.split(": ")[0] for w in lint(config) if "ignored" in w}
    assert said == {key["path"] for key in event["ignored"]}


async def test_a_config_full_of_unknown_keys_lists_the_first_twenty() -> None:
    config: Mapping[str, Any] = {f"unknown{i:03}": i for i in range(100)}
    with capture_retry_events() as events:
        await _insecure(config)
    [event] = events
    assert event["count"] == 100
    assert len(event["ignored"]) == _log.GRPC_CONFIG_IGNORED_SHOWN == 20
    assert event["ignored"][0]["path"] == "unknown000"


async def test_on_the_stdlib_logger_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Without structlog configured the event reaches ``logging.getLogger("sdkcore")``
    at WARNING; with that logger above WARNING nothing is logged."""
    with caplog.at_level(logging.WARNING, logger="sdkcore"):
        await _insecure(TYPO)
    [record] = [r for r in caplog.records if r.name == "sdkcore"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(f"grpc.config_ignored target='{TARGET}' ignored=[")
    assert "did you mean" not in record.getMessage()  # the fields, not check-config's text
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="sdkcore"):
        await _insecure(TYPO)
    assert [r for r in caplog.records if r.name == "sdkcore"] == []
