"""Bad input to sdkcore.mapping and sdkcore.grpc helpers: refused naming the field.

Each refusal is a TypeError or ValueError whose message names the function and the
argument (and says what is allowed); the valid spelling of the same call still works,
and a live object (RetryStats) is left as it was.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from sdkcore import CasMismatchException, ErrorContext, Request, RetryableError, RetryReason
from sdkcore import mapping as m

grpc = pytest.importorskip("sdkcore.grpc")
grpcio = pytest.importorskip("grpc")

ERROR_MAP = m.ErrorMap.from_json(
    '{"version": 2, "revision": 1, "errors": {"99": {"name": "X", "desc": "d", '
    '"attrs": ["retry-now"]}}}'
)


def _context() -> ErrorContext:
    return Request(idempotent=True).error_context()


# --- sdkcore.mapping: KV ------------------------------------------------------------------


@pytest.mark.parametrize("status", [0x07, 0x99, 0x01])  # a table row, the map's row, neither
@pytest.mark.parametrize("bad", [{}, "x", 5, m.ErrorMap])
def test_kv_retry_reason_refuses_an_error_map_that_is_not_one(status: int, bad: object) -> None:
    with pytest.raises(TypeError, match=r"kv_retry_reason\(error_map\) must be an sdkcore"):
        m.kv_retry_reason(status, 0, bad)  # type: ignore[arg-type]


def test_kv_retry_reason_still_reads_the_error_map() -> None:
    assert m.kv_retry_reason(0x99, 0, ERROR_MAP) is RetryReason.KV_ERROR_MAP_RETRY_INDICATED
    assert m.kv_retry_reason(0x99, 0, None) is None
    assert m.kv_retry_reason(0x07, 0, ERROR_MAP) is RetryReason.KV_NOT_MY_VBUCKET


@pytest.mark.parametrize("status", [0x07, 0x01])  # retryable (returns a reason) or not
def test_kv_failure_refuses_bad_arguments_retryable_or_not(status: int) -> None:
    with pytest.raises(TypeError, match=r"kv_failure\(error_map\) must be an sdkcore"):
        m.kv_failure(status, 0, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kv_failure\(with_cas\) must be a bool"):
        m.kv_failure(status, 0, with_cas="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kv_failure\(with_cas\) must be a bool"):
        m.kv_failure(status, 0, with_cas=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kv_failure\(context\) must be an sdkcore.ErrorContext"):
        m.kv_failure(status, 0, context="x")  # type: ignore[arg-type]


def test_kv_exception_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"kv_exception\(error_map\) must be an sdkcore"):
        m.kv_exception(1, 0, error_map=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kv_exception\(with_cas\) must be a bool"):
        m.kv_exception(2, 0, with_cas="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kv_exception\(context\) must be an sdkcore"):
        m.kv_exception(1, 0, context=5)  # type: ignore[arg-type]


def test_kv_failure_and_exception_still_take_good_arguments() -> None:
    context = _context()
    failure = m.kv_failure(0x02, 0, ERROR_MAP, with_cas=True, context=context)
    assert isinstance(failure, CasMismatchException)
    assert failure.context is context
    assert m.kv_failure(0x99, 0, ERROR_MAP, with_cas=False, context=context) is (
        RetryReason.KV_ERROR_MAP_RETRY_INDICATED
    )
    assert "X" in str(m.kv_exception(0x99, 0, error_map=ERROR_MAP))


# --- sdkcore.mapping: gRPC status, raise_failure --------------------------------------------


@pytest.mark.parametrize("code", [14, 5])  # a RetryableError (no context used) or an exception
def test_grpc_failure_refuses_a_context_that_is_not_one(code: int) -> None:
    with pytest.raises(TypeError, match=r"grpc_failure\(context\) must be an sdkcore.ErrorContext"):
        m.grpc_failure(code, context="x")  # type: ignore[arg-type]
    context = _context()
    assert m.grpc_failure(code, context=context) is not None


def test_raise_failure_refuses_a_request_that_is_not_one() -> None:
    with pytest.raises(TypeError, match=r"raise_failure\(request\) must be an sdkcore.Request"):
        m.raise_failure(RetryReason.KV_LOCKED, request="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"raise_failure\(request\)"):
        m.raise_failure(ValueError("boom"), request=Request)  # type: ignore[arg-type]
    with pytest.raises(RetryableError):
        m.raise_failure(RetryReason.KV_LOCKED, request=Request(idempotent=True))


# --- sdkcore.mapping: ErrorMap, ErrorCode --------------------------------------------------

_CODE = m.ErrorCode(0x99, "X", "d", frozenset({"retry-now"}))


@pytest.mark.parametrize(
    ("errors", "error", "words"),
    [
        (None, TypeError, "ErrorMap.errors must be a mapping"),
        ([1], TypeError, "ErrorMap.errors must be a mapping"),
        ({1: "x"}, TypeError, "ErrorMap.errors[1] must be an sdkcore.mapping.ErrorCode"),
        ({"99": _CODE}, TypeError, "ErrorMap.errors keys must be int"),
        ({True: _CODE}, TypeError, "ErrorMap.errors keys must be int"),
        ({0x98: _CODE}, ValueError, "ErrorMap.errors[152] holds the entry for status 0x99"),
    ],
)
def test_error_map_refuses_errors_that_are_not_status_to_entry(
    errors: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as info:
        m.ErrorMap(1, 0, errors)
    assert words in str(info.value)


def test_error_map_built_directly_still_works() -> None:
    built = m.ErrorMap(1, 0, {0x99: _CODE})
    assert built.retry_indicated(0x99)
    assert m.ErrorMap(1, 0, {}).retry_statuses == frozenset()


@pytest.mark.parametrize(
    ("attrs", "words"),
    [
        ("retry-now", "ErrorCode.attrs must be an iterable of str"),
        (None, "ErrorCode.attrs must be an iterable of str"),
        (5, "ErrorCode.attrs must be an iterable of str"),
        ({"retry-now": 1}, "ErrorCode.attrs must be an iterable of str"),
        ([1], "ErrorCode.attrs must hold only str"),
        ([["retry-now"]], "ErrorCode.attrs must hold only str"),
    ],
)
def test_error_code_refuses_attrs_that_are_not_names(attrs: Any, words: str) -> None:
    with pytest.raises(TypeError) as info:
        m.ErrorCode(1, "N", "d", attrs)
    assert words in str(info.value)


def test_error_code_refuses_a_retry_that_is_not_a_spec() -> None:
    with pytest.raises(TypeError, match=r"ErrorCode.retry must be an sdkcore.mapping.RetrySpec"):
        m.ErrorCode(1, "N", "d", frozenset(), retry="x")  # type: ignore[arg-type]


def test_error_code_still_takes_any_iterable_of_names_and_a_spec() -> None:
    spec = m.RetrySpec(m.RetrySpecStrategy.CONSTANT, 10, 0)
    code = m.ErrorCode(1, "N", "d", ["retry-later", "temp"], retry=spec)
    assert code.attrs == frozenset({"retry-later", "temp"})
    assert code.retry_indicated
    assert m.ErrorCode(1, "N", "d", iter(())).attrs == frozenset()


# --- sdkcore.grpc: channel keywords ----------------------------------------------------------


def _channel(**kwargs: Any) -> object:
    async def build() -> object:
        channel = grpc.insecure_channel(kwargs.pop("target", "localhost:1"), **kwargs)
        await channel.close()
        return channel

    return asyncio.run(build())


async def _async_size(message: object) -> int:
    return 1


class _AsyncCallable:
    async def __call__(self, message: object) -> int:
        return 1


@pytest.mark.parametrize("bad", [_async_size, _AsyncCallable()])
def test_channel_refuses_an_async_message_size(bad: object) -> None:
    with pytest.raises(
        TypeError,
        match=r"RetryController\(message_size=...\) must be a callable .*coroutine function",
    ):
        _channel(message_size=bad)


@pytest.mark.parametrize("target", ["", "   "])
def test_channel_refuses_an_empty_target(target: str) -> None:
    with pytest.raises(ValueError, match=r"RetryController\(target\) must be a non-empty"):
        _channel(target=target)


@pytest.mark.parametrize("bad", ["gzip", 2, grpcio.Compression])
def test_channel_refuses_a_compression_that_is_not_one(bad: object) -> None:
    with pytest.raises(TypeError, match=r"compression must be a grpc.Compression"):
        _channel(compression=bad)


def test_channel_still_takes_good_keywords() -> None:
    assert _channel(message_size=lambda message: 1, compression=grpcio.Compression.Gzip)


# --- sdkcore.grpc: helpers --------------------------------------------------------------------


def test_a6_retry_strategy_refuses_bad_policy_throttler_rng() -> None:
    with pytest.raises(TypeError, match=r"A6RetryStrategy\(policy\) must be an sdkcore.grpc"):
        grpc.A6RetryStrategy("x")
    with pytest.raises(TypeError, match=r"A6RetryStrategy\(throttler\) must be an sdkcore.grpc"):
        grpc.A6RetryStrategy(None, throttler="x")
    for bad in (5, random.Random):
        with pytest.raises(TypeError, match=r"A6RetryStrategy\(rng\) must be a random.Random"):
            grpc.A6RetryStrategy(None, rng=bad)
    strategy = grpc.A6RetryStrategy(
        None, throttler=grpc.RetryThrottler(10, 0.1), rng=random.Random(1)
    )
    assert strategy.throttler is not None


def test_call_context_refuses_what_is_not_an_exception() -> None:
    for bad in ("x", None, ValueError):
        with pytest.raises(TypeError, match=r"call_context\(error\) must be the exception"):
            grpc.call_context(bad)
    assert grpc.call_context(ValueError("not from a channel")) is None


def test_previous_rpc_attempts_refuses_what_is_not_metadata() -> None:
    for bad in (5, 0, "ab", [1, 2]):
        with pytest.raises(TypeError, match=r"previous_rpc_attempts\(error_or_metadata\)"):
            grpc.previous_rpc_attempts(bad)
    assert grpc.previous_rpc_attempts((("grpc-previous-rpc-attempts", "2"),)) == 2
    assert grpc.previous_rpc_attempts(()) == 0
    assert grpc.previous_rpc_attempts(None) == 0


def test_parse_pushback_refuses_values_that_are_not_an_iterable_of_values() -> None:
    for bad in (None, 5, "10", b"10"):
        with pytest.raises(TypeError, match=r"parse_pushback\(values\) must be an iterable"):
            grpc.parse_pushback(bad)
    assert grpc.parse_pushback(["10"]) == 10
    assert grpc.parse_pushback(("10",)) == 10
    assert grpc.parse_pushback([]) is None


def test_retry_stats_refuse_bad_method_and_retry_number_and_count_nothing() -> None:
    stats = grpc.RetryStats()
    stats.record_retry("/a.S/M", 1)
    shown = repr(stats)
    bad: list[tuple[Callable[[], object], str]] = [
        (lambda: stats.record_retry(None, 1), r"RetryStats.record_retry\(method\) must be a str"),
        (lambda: stats.record_retry(["m"], 1), r"RetryStats.record_retry\(method\) must be a str"),
        (lambda: stats.record_retry("/a.S/M", "1"), r"record_retry\(retry_number\) must be an int"),
        (lambda: stats.record_retry("/a.S/M", True), r"record_retry\(retry_number\) must be an"),
        (lambda: stats.record_failed_retry(5), r"RetryStats.record_failed_retry\(method\)"),
        (lambda: stats.for_method(None), r"RetryStats.for_method\(method\) must be a str"),
        (lambda: stats.for_method([1]), r"RetryStats.for_method\(method\) must be a str"),
    ]
    for call, words in bad:
        with pytest.raises(TypeError, match=words):
            call()
    with pytest.raises(ValueError, match=r"retry_number must be >= 1"):
        stats.record_retry("/a.S/M", 0)
    assert repr(stats) == shown
    stats.record_retry("/a.S/M", 2)
    assert stats.for_method("/a.S/M").retry_attempts == 2
    assert stats.for_method("/other/M").retry_attempts == 0


def test_service_config_method_config_and_method_name_refuse_non_str() -> None:
    with pytest.raises(TypeError, match=r"ServiceConfig.method_config\(full_method\) must be"):
        grpc.ServiceConfig().method_config(None)
    with pytest.raises(TypeError, match=r"MethodName\(service\) must be a str"):
        grpc.MethodName(None)
    with pytest.raises(TypeError, match=r"MethodName\(method\) must be a str"):
        grpc.MethodName("pkg.S", 5)
    assert grpc.ServiceConfig().method_config("/pkg.S/M") is None
    assert grpc.MethodName("pkg.S", "M").service == "pkg.S"
