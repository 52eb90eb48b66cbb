# mypy: disable-error-code="arg-type"
# (the point of this file is passing wrong argument types and checking the runtime refusals)
"""Bad input beyond bad numbers: wrong types, empty strings, unknown enum names, classes
for instances, sync callables for async ones (and back), out-of-range values.

The rule: bad input gets a TypeError or ValueError whose message names the field (never
AttributeError, KeyError, IndexError, OverflowError or an internal error), and a live
object is left as it was: the next good call works, its counters unchanged.

Bad numbers on constructors are tests/test_bad_numbers.py and test_bad_numbers_core.py;
this sweep covers the rest. The ``BUGS`` section at the end holds what the sweep found
wrong (2026-11-27), 64 cases, each fixed since: they must stay refused.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import warnings
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

import pytest
from bad_numbers import judge

import sdkcore
from sdkcore import (
    AdaptiveConcurrencyLimiter,
    AdaptiveThrottle,
    BestEffortRetryStrategy,
    CircuitBreaker,
    ConcurrencyLimiter,
    CouchbaseException,
    FastFailOnTerminalErrorRetryStrategy,
    HedgePolicy,
    LatencyQuantile,
    OrphanReporter,
    Request,
    RequestState,
    RetryableError,
    RetryAction,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    Telemetry,
    ThresholdReporter,
    best_effort_backoff,
    describe_error,
    exponential_backoff,
)
from sdkcore import mapping as m
from sdkcore import testing as t

random.seed(20261127)  # the sweep is deterministic; seeded for any future sampling

# A bad async callable where a sync one belongs leaves an un-awaited coroutine behind.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")

KL = RetryReason.KV_LOCKED
Call = Callable[[], object]


# --- callables of the wrong colour ---------------------------------------------------------


async def _async_send(request: Request) -> str:
    return "ok"


async def _async_hedge_send(request: Request, index: int) -> str:
    return "ok"


async def _async_clock() -> float:
    return 1.0


async def _async_sleep(seconds: float) -> None:
    return None


async def _async_predicate(error: BaseException) -> bool:
    return False


def _sync_send(request: Request) -> str:
    return "ok"


def _run(value: object) -> object:
    """Drives a coroutine (the async doors) to completion; other results pass through."""
    if isinstance(value, Coroutine):
        return asyncio.run(value)
    return value


def _req() -> Request:
    return Request(idempotent=True)


def _orch() -> RetryOrchestrator:
    return RetryOrchestrator()


def _refused(call: Call, named: str) -> BaseException:
    """``call()`` raises TypeError or ValueError naming ``named``; anything else fails."""
    error: TypeError | ValueError | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # un-awaited coroutines of bad args
            result = _run(call())
    except (TypeError, ValueError) as exc:  # judged below; anything else fails the test
        error = exc
    if error is None:
        raise AssertionError(f"accepted, returned {result!r}; expected a TypeError/ValueError")
    assert not isinstance(error, OverflowError), repr(error)
    message = str(error)
    assert named in message, f"{type(error).__name__}: {message}"
    assert len(message) < 1000
    return error


def _case(named: str, call: Call, case_id: str) -> Any:
    return pytest.param(named, call, id=case_id)


# --- what is refused today, and must stay so ------------------------------------------------

REFUSED: list[Any] = [
    # Request
    _case("Request.name", lambda: Request(name=None), "Request(name=None)"),
    _case("Request.name", lambda: Request(name=5), "Request(name=int)"),
    _case("Request.idempotent", lambda: Request(idempotent="yes"), "Request(idempotent=str)"),
    _case("Request.idempotent", lambda: Request(idempotent=None), "Request(idempotent=None)"),
    _case("Request.timeout", lambda: Request(timeout="1s"), "Request(timeout=str)"),
    _case("Request.timeout", lambda: Request(timeout=[1]), "Request(timeout=list)"),
    _case(
        "retry_strategy",
        lambda: Request(retry_strategy=BestEffortRetryStrategy),
        "Request(retry_strategy=class)",
    ),
    _case("retry_strategy", lambda: Request(retry_strategy="x"), "Request(retry_strategy=str)"),
    _case("client_context", lambda: Request(client_context=[("a", "b")]), "client_context=list"),
    _case("client_context", lambda: Request(client_context="ab"), "client_context=str"),
    # RetryOrchestrator
    _case("default_strategy", lambda: RetryOrchestrator("x"), "Orchestrator(strategy=str)"),
    _case(
        "default_strategy",
        lambda: RetryOrchestrator(BestEffortRetryStrategy),
        "Orchestrator(strategy=class)",
    ),
    _case("sleep", lambda: RetryOrchestrator(sleep=5), "Orchestrator(sleep=int)"),
    _case("retry_budget", lambda: RetryOrchestrator(retry_budget="x"), "Orchestrator(budget=str)"),
    _case("telemetry", lambda: RetryOrchestrator(telemetry="x"), "Orchestrator(telemetry=str)"),
    _case("telemetry", lambda: RetryOrchestrator(telemetry=Telemetry), "Orchestrator(tel=class)"),
    _case("request", lambda: _orch().execute(None, _async_send), "execute(request=None)"),
    _case("request", lambda: _orch().execute(Request, _async_send), "execute(request=class)"),
    _case("send", lambda: _orch().execute(_req(), None), "execute(send=None)"),
    _case("send", lambda: _orch().execute(_req(), "x"), "execute(send=str)"),
    _case("send", lambda: _orch().execute(_req(), _sync_send), "execute(send=sync)"),
    _case("request", lambda: _orch().execute_sync(None, _sync_send), "execute_sync(request=None)"),
    _case("send", lambda: _orch().execute_sync(_req(), None), "execute_sync(send=None)"),
    _case("send", lambda: _orch().execute_sync(_req(), _async_send), "execute_sync(send=async)"),
    _case("request", lambda: _orch().maybe_retry(None, KL), "maybe_retry(request=None)"),
    _case("reason", lambda: _orch().maybe_retry(_req(), None), "maybe_retry(reason=None)"),
    _case("reason", lambda: _orch().maybe_retry(_req(), "KV_LOCKED"), "maybe_retry(reason=name)"),
    _case("reason", lambda: _orch().maybe_retry(_req(), "NOPE"), "maybe_retry(reason=unknown)"),
    _case("reason", lambda: _orch().maybe_retry(_req(), 5), "maybe_retry(reason=int)"),
    _case("cause", lambda: _orch().maybe_retry(_req(), KL, cause="x"), "maybe_retry(cause=str)"),
    _case(
        "cause", lambda: _orch().maybe_retry(_req(), KL, cause=ValueError), "maybe_retry(cause=cls)"
    ),
    _case("effect", lambda: _orch().maybe_retry(_req(), KL, effect="x"), "maybe_retry(effect=str)"),
    _case(
        "retry_after",
        lambda: _orch().maybe_retry(_req(), KL, retry_after="1"),
        "maybe_retry(retry_after=str)",
    ),
    _case("request", lambda: _orch().attempt(None).__enter__(), "attempt(None)"),
    _case("request", lambda: _orch().attempt("x").__enter__(), "attempt(str)"),
    _case("error", lambda: _orch().fail(_req(), None), "fail(error=None)"),
    _case("error", lambda: _orch().fail(_req(), ValueError), "fail(error=class)"),
    _case("error", lambda: _orch().fail(_req(), "x"), "fail(error=str)"),
    _case("policy", lambda: _orch().hedge(_req(), _async_hedge_send, None), "hedge(policy=None)"),
    _case(
        "policy", lambda: _orch().hedge(_req(), _async_hedge_send, HedgePolicy), "hedge(policy=cls)"
    ),
    _case(
        "request",
        lambda: _orch().hedge(None, _async_hedge_send, HedgePolicy(2)),
        "hedge(request=None)",
    ),
    _case("send", lambda: _orch().hedge(_req(), None, HedgePolicy(2)), "hedge(send=None)"),
    _case(
        "throttler",
        lambda: _orch().hedge(_req(), _async_hedge_send, HedgePolicy(2), throttler="x"),
        "hedge(throttler=str)",
    ),
    # RetryAction, RetryableError
    _case(
        "with_duration(duration)", lambda: RetryAction.with_duration(None), "with_duration(None)"
    ),
    _case("with_duration(duration)", lambda: RetryAction.with_duration("1"), "with_duration(str)"),
    _case("no_retry(exception", lambda: RetryAction.no_retry("x"), "no_retry(str)"),
    _case("no_retry(exception", lambda: RetryAction.no_retry(5), "no_retry(int)"),
    _case("RetryAction(duration)", lambda: RetryAction("1"), "RetryAction(duration=str)"),
    _case("why", lambda: RetryAction(None, why=5), "RetryAction(why=int)"),
    _case("reason", lambda: RetryableError(None), "RetryableError(reason=None)"),
    _case("reason", lambda: RetryableError("KV_LOCKED"), "RetryableError(reason=name)"),
    _case("reason", lambda: RetryableError("NOPE"), "RetryableError(reason=unknown)"),
    _case("cause", lambda: RetryableError(KL, cause=ValueError), "RetryableError(cause=class)"),
    _case("effect", lambda: RetryableError(KL, effect="NOPE"), "RetryableError(effect=str)"),
    _case("retry_after", lambda: RetryableError(KL, retry_after=[1]), "RetryableError(ra=list)"),
    # RetryBudget
    _case("ttl", lambda: RetryBudget(ttl=None), "RetryBudget(ttl=None)"),
    _case("min_retries_per_sec", lambda: RetryBudget(min_retries_per_sec=None), "Budget(min=None)"),
    _case("retry_ratio", lambda: RetryBudget(retry_ratio=None), "RetryBudget(ratio=None)"),
    _case("clock", lambda: RetryBudget(clock=None), "RetryBudget(clock=None)"),
    _case("name", lambda: RetryBudget(name=5), "RetryBudget(name=int)"),
    # CircuitBreaker
    _case("volume_threshold", lambda: CircuitBreaker(volume_threshold=None), "CB(volume=None)"),
    _case(
        "error_threshold", lambda: CircuitBreaker(error_threshold_percentage="5"), "CB(err%=str)"
    ),
    _case(
        "error_threshold", lambda: CircuitBreaker(error_threshold_percentage=150), "CB(err%=150)"
    ),
    _case("error_threshold", lambda: CircuitBreaker(error_threshold_percentage=True), "CB(%=bool)"),
    _case("rolling_window", lambda: CircuitBreaker(rolling_window="1"), "CB(rolling=str)"),
    _case("rolling_window", lambda: CircuitBreaker(rolling_window=0), "CB(rolling=0)"),
    _case("is_failure", lambda: CircuitBreaker(is_failure=5), "CB(is_failure=int)"),
    _case("clock", lambda: CircuitBreaker(clock=None), "CB(clock=None)"),
    _case("name", lambda: CircuitBreaker(name=5), "CB(name=int)"),
    _case("guard(request)", lambda: CircuitBreaker().guard("x"), "CB.guard(str)"),
    _case("record_failure(error)", lambda: CircuitBreaker().record_failure(None), "CB.fail(None)"),
    _case(
        "record_failure(error)", lambda: CircuitBreaker().record_failure(ValueError), "CB.f(cls)"
    ),
    # limiters, throttle
    _case("limit", lambda: ConcurrencyLimiter(None), "Limiter(limit=None)"),
    _case("limit", lambda: ConcurrencyLimiter("3"), "Limiter(limit=str)"),
    _case("limit", lambda: ConcurrencyLimiter(True), "Limiter(limit=bool)"),
    _case("max_queued", lambda: ConcurrencyLimiter(1, max_queued="1"), "Limiter(max_queued=str)"),
    _case("name", lambda: ConcurrencyLimiter(1, name=None), "Limiter(name=None)"),
    _case("clock", lambda: ConcurrencyLimiter(1, clock=5), "Limiter(clock=int)"),
    _case("acquire", lambda: ConcurrencyLimiter(1).acquire(5), "Limiter.acquire(extra arg)"),  # type: ignore[call-arg]
    _case("guard", lambda: ConcurrencyLimiter(1).guard(5), "Limiter.guard(extra arg)"),  # type: ignore[call-arg]
    _case("initial_limit", lambda: AdaptiveConcurrencyLimiter("3"), "Adaptive(initial=str)"),
    _case("min_limit", lambda: AdaptiveConcurrencyLimiter(min_limit=300), "Adaptive(min>max)"),
    _case("max_limit", lambda: AdaptiveConcurrencyLimiter(max_limit=None), "Adaptive(max=None)"),
    _case("name", lambda: AdaptiveConcurrencyLimiter(name=5), "Adaptive(name=int)"),
    _case("k", lambda: AdaptiveThrottle("2"), "Throttle(k=str)"),
    _case("k", lambda: AdaptiveThrottle(True), "Throttle(k=bool)"),
    _case("window", lambda: AdaptiveThrottle(window="1"), "Throttle(window=str)"),
    _case("name", lambda: AdaptiveThrottle(name=None), "Throttle(name=None)"),
    _case("random", lambda: AdaptiveThrottle(random=5), "Throttle(random=int)"),
    _case("is_rejection", lambda: AdaptiveThrottle(is_rejection=5), "Throttle(is_rejection=int)"),
    _case("record_failure(error)", lambda: AdaptiveThrottle().record_failure("x"), "Throttle.f(s)"),
    _case("guard", lambda: AdaptiveThrottle().guard(5), "Throttle.guard(extra arg)"),  # type: ignore[call-arg]
    # LatencyQuantile, HedgePolicy
    _case("max_extra_load", lambda: LatencyQuantile("x"), "Quantile(load=str)"),
    _case("window", lambda: LatencyQuantile(window=None), "Quantile(window=None)"),
    _case("max_delay", lambda: LatencyQuantile(min_delay=1, max_delay=0.5), "Quantile(max<min)"),
    _case("min_samples", lambda: LatencyQuantile(min_samples=None), "Quantile(min_samples=None)"),
    _case("clock", lambda: LatencyQuantile(clock=5), "Quantile(clock=int)"),
    _case("record(latency)", lambda: LatencyQuantile().record(None), "Quantile.record(None)"),
    _case("record(latency)", lambda: LatencyQuantile().record("1"), "Quantile.record(str)"),
    _case("max_attempts", lambda: HedgePolicy(None), "HedgePolicy(max_attempts=None)"),
    _case("delay", lambda: HedgePolicy(2, delay="x"), "HedgePolicy(delay=str)"),
    _case("delay", lambda: HedgePolicy(2, delay=LatencyQuantile), "HedgePolicy(delay=class)"),
    _case("non_fatal", lambda: HedgePolicy(2, non_fatal=5), "HedgePolicy(non_fatal=int)"),
    _case("non_fatal", lambda: HedgePolicy(2, non_fatal="x"), "HedgePolicy(non_fatal=str)"),
    _case("non_fatal", lambda: HedgePolicy(2, non_fatal=["NOPE"]), "HedgePolicy(non_fatal=names)"),
    _case("non_fatal", lambda: HedgePolicy(2, non_fatal=_async_send), "HedgePolicy(non_fatal=fn)"),
    _case("pushback", lambda: HedgePolicy(2, pushback=5), "HedgePolicy(pushback=int)"),
    _case(
        "max_attempts_cap", lambda: HedgePolicy(2, max_attempts_cap=None), "HedgePolicy(cap=None)"
    ),
    # Telemetry
    _case("meter_provider", lambda: Telemetry("x"), "Telemetry(meter_provider=str)"),
    _case("tracer_provider", lambda: Telemetry(None, 5), "Telemetry(tracer_provider=int)"),
    _case("threshold_reporter", lambda: Telemetry(threshold_reporter="x"), "Telemetry(tr=str)"),
    _case(
        "threshold_reporter",
        lambda: Telemetry(threshold_reporter=ThresholdReporter),
        "Telemetry(tr=class)",
    ),
    _case("watch(target)", lambda: Telemetry().watch(None), "Telemetry.watch(None)"),
    _case("watch(target)", lambda: Telemetry().watch("x"), "Telemetry.watch(str)"),
    _case("watch(target)", lambda: Telemetry().watch(CircuitBreaker), "Telemetry.watch(class)"),
    _case("watch(name", lambda: Telemetry().watch(CircuitBreaker(), name=5), "watch(name=int)"),
    # ThresholdReporter, OrphanReporter
    _case("kv_threshold", lambda: ThresholdReporter(kv_threshold="1"), "Threshold(kv=str)"),
    _case("kv_threshold", lambda: ThresholdReporter(kv_threshold=True), "Threshold(kv=bool)"),
    _case("query_threshold", lambda: ThresholdReporter(query_threshold="1"), "Threshold(q=str)"),
    _case(
        "default_threshold", lambda: ThresholdReporter(default_threshold=None), "Threshold(d=None)"
    ),
    _case("sample_size", lambda: ThresholdReporter(sample_size=None), "Threshold(sample=None)"),
    _case("sample_size", lambda: ThresholdReporter(sample_size=True), "Threshold(sample=bool)"),
    _case("emit_interval", lambda: ThresholdReporter(emit_interval=None), "Threshold(emit=None)"),
    _case("clock", lambda: ThresholdReporter(clock=5), "Threshold(clock=int)"),
    _case("sample_size", lambda: OrphanReporter(sample_size=None), "Orphan(sample=None)"),
    _case("sample_size", lambda: OrphanReporter(sample_size=True), "Orphan(sample=bool)"),
    _case("emit_interval", lambda: OrphanReporter(emit_interval=None), "Orphan(emit=None)"),
    _case("clock", lambda: OrphanReporter(clock=None), "Orphan(clock=None)"),
    # backoff and strategies
    _case("lower", lambda: exponential_backoff(lower=None), "exponential_backoff(lower=None)"),
    _case("upper", lambda: exponential_backoff(lower=1, upper=0.5), "exponential_backoff(lo>up)"),
    _case("factor", lambda: exponential_backoff(factor=None), "exponential_backoff(factor=None)"),
    _case("backoff", lambda: BestEffortRetryStrategy(backoff=5), "BestEffort(backoff=int)"),
    _case("backoff", lambda: FastFailOnTerminalErrorRetryStrategy(backoff="x"), "FastFail(b=str)"),
    _case(
        "backoff(0)",  # a plain function returning an awaitable: refused when it answers
        lambda: BestEffortRetryStrategy(backoff=lambda attempt: _async_clock()).decide(_req(), KL),  # type: ignore[return-value]
        "BestEffort(backoff=returns awaitable).decide",
    ),
    # sdkcore.mapping
    _case("service", lambda: m.http_request("nope", "GET"), "http_request(service=unknown)"),
    _case("service", lambda: m.http_request(None, "GET"), "http_request(service=None)"),
    _case("method", lambda: m.http_request("query", ""), "http_request(method='')"),
    _case("method", lambda: m.http_request("query", 5), "http_request(method=int)"),
    _case("readonly", lambda: m.is_idempotent_http("query", "GET", readonly="x"), "readonly=str"),
    _case("idempotent", lambda: m.kv_request(0, idempotent=True), "kv_request(idempotent=)"),
    _case("body", lambda: m.search_retry_reason(429, None), "search_retry_reason(body=None)"),
    _case("body", lambda: m.views_retry_reason(500, 5), "views_retry_reason(body=int)"),
    _case("body", lambda: m.search_exception(429, [1]), "search_exception(body=list)"),
    _case("errors", lambda: m.query_retry_reason(None), "query_retry_reason(None)"),
    _case("errors", lambda: m.query_retry_reason({"code": 1}), "query_retry_reason(dict)"),
    _case("errors[0]", lambda: m.query_retry_reason([5]), "query_retry_reason([int])"),  # type: ignore[list-item]
    _case("errors", lambda: m.analytics_retry_reason("x"), "analytics_retry_reason(str)"),
    _case("stage", lambda: m.dispatch_failure_reason("nope"), "dispatch_failure_reason(str)"),
    _case("reason", lambda: m.retry_allowed("KV_LOCKED", idempotent=True), "retry_allowed(name)"),
    _case("idempotent", lambda: m.retry_allowed(KL, idempotent="x"), "retry_allowed(idem=str)"),
    _case("result", lambda: m.raise_failure(None), "raise_failure(None)"),
    _case("result", lambda: m.raise_failure(ValueError), "raise_failure(class)"),
    _case("effect", lambda: m.raise_failure(KL, effect="x"), "raise_failure(effect=str)"),
    _case("value", lambda: m.parse_retry_after(5), "parse_retry_after(int)"),
    _case("now", lambda: m.parse_retry_after("1", now="x"), "parse_retry_after(now=str)"),
    _case("status code", lambda: m.grpc_code("NOPE"), "grpc_code(unknown name)"),
    _case("status code", lambda: m.grpc_code(""), "grpc_code('')"),
    _case("status code", lambda: m.grpc_code([1]), "grpc_code(list)"),
    _case("message", lambda: m.grpc_failure(14, 5), "grpc_failure(message=int)"),
    _case("details", lambda: m.grpc_failure(14, "", 5), "grpc_failure(details=int)"),
    _case("read_only", lambda: m.grpc_failure(14, read_only="x"), "grpc_failure(read_only=str)"),
    _case("ErrorCode.name", lambda: m.ErrorCode(1, None, "d", frozenset()), "ErrorCode(name=None)"),
    _case("ErrorCode.desc", lambda: m.ErrorCode(1, "N", None, frozenset()), "ErrorCode(desc=None)"),
    _case("from_json(data)", lambda: m.ErrorMap.from_json(None), "ErrorMap.from_json(None)"),
    _case("RetrySpec.strategy", lambda: m.RetrySpec("constant", 1, 1), "RetrySpec(strategy=name)"),
    _case("RetrySpec.strategy", lambda: m.RetrySpec(None, 1, 1), "RetrySpec(strategy=None)"),
    # sdkcore.testing
    _case("ScriptedSend(script)", lambda: t.ScriptedSend("abc"), "ScriptedSend(str)"),
    _case("ScriptedSend(script)", lambda: t.ScriptedSend([]), "ScriptedSend([])"),
    _case("indexes", lambda: t.ScriptedSend({"x": [1]}), "ScriptedSend({str: ...})"),
]


@pytest.mark.parametrize(("named", "call"), REFUSED)
def test_bad_input_is_refused_naming_the_field(named: str, call: Call) -> None:
    _refused(call, named)


# --- sdkcore.grpc: the channel helpers' keywords --------------------------------------------


def _grpc() -> Any:
    return pytest.importorskip("sdkcore.grpc")


def _channel(**kwargs: Any) -> object:
    grpc = _grpc()

    async def build() -> object:
        channel = grpc.insecure_channel(kwargs.pop("target", "localhost:1"), **kwargs)
        await channel.close()
        return channel

    return asyncio.run(build())


CHANNEL_REFUSED: list[Any] = [
    pytest.param("target", {"target": None}, id="target=None"),
    pytest.param("target", {"target": 5}, id="target=int"),
    pytest.param("service_config must be", {"service_config": 5}, id="service_config=int"),
    pytest.param("service_config must be", {"service_config": [1]}, id="service_config=list"),
    pytest.param("options", {"options": "x"}, id="options=str"),
    pytest.param("options", {"options": {"a": 1}}, id="options=dict"),
    pytest.param("enabled", {"retries_enabled": "yes"}, id="retries_enabled=str"),
    pytest.param("enabled", {"retries_enabled": None}, id="retries_enabled=None"),
    pytest.param("max_attempts_cap", {"max_attempts_cap": None}, id="max_attempts_cap=None"),
    pytest.param("max_attempts_cap", {"max_attempts_cap": "5"}, id="max_attempts_cap=str"),
    pytest.param("max_attempts_cap", {"max_attempts_cap": True}, id="max_attempts_cap=bool"),
    pytest.param("backoff_jitter", {"backoff_jitter": "full"}, id="backoff_jitter=name"),
    pytest.param("backoff_jitter", {"backoff_jitter": None}, id="backoff_jitter=None"),
    pytest.param("per_call_buffer_limit", {"per_call_buffer_limit": "1"}, id="per_call=str"),
    pytest.param("per_call_buffer_limit", {"per_call_buffer_limit": True}, id="per_call=bool"),
    pytest.param("channel_buffer_limit", {"channel_buffer_limit": None}, id="channel_buf=None"),
    pytest.param("transparent_retries", {"transparent_retries": "yes"}, id="transparent=str"),
    pytest.param("transparent_retry_limit", {"transparent_retry_limit": None}, id="t_limit=None"),
    pytest.param("stats", {"stats": "x"}, id="stats=str"),
    pytest.param("message_size", {"message_size": 5}, id="message_size=int"),
    pytest.param("retry_budget", {"retry_budget": "x"}, id="retry_budget=str"),
    pytest.param("retry_budget", {"retry_budget": RetryBudget}, id="retry_budget=class"),
    pytest.param("telemetry", {"telemetry": "x"}, id="telemetry=str"),
    pytest.param("hedge_delay", {"hedge_delay": 5}, id="hedge_delay=int"),
    pytest.param("hedge_delay", {"hedge_delay": LatencyQuantile()}, id="hedge_delay=instance"),
    pytest.param("limiter", {"limiter": "x"}, id="limiter=str"),
    pytest.param("limiter", {"limiter": ConcurrencyLimiter}, id="limiter=class"),
    pytest.param("throttle", {"throttle": "x"}, id="throttle=str"),
    pytest.param("throttle", {"throttle": AdaptiveThrottle}, id="throttle=class"),
]


@pytest.mark.parametrize(("named", "kwargs"), CHANNEL_REFUSED)
def test_channel_keyword_is_refused_naming_it(named: str, kwargs: dict[str, Any]) -> None:
    _refused(lambda: _channel(**kwargs), named)


def test_channel_stats_class_is_refused() -> None:
    grpc = _grpc()
    _refused(lambda: _channel(stats=grpc.RetryStats), "stats")


def test_grpc_helpers_refuse_bad_arguments() -> None:
    grpc = _grpc()
    _refused(lambda: grpc.throttler_for_target(None, 10, 0.1), "target")
    _refused(lambda: grpc.throttler_for_target("t", "10", 0.1), "max_tokens")
    _refused(lambda: grpc.RetryThrottler(10, None), "token_ratio")
    _refused(lambda: grpc.RetryThrottler(10, 0.1, replaces="x"), "replaces")
    _refused(lambda: grpc.A6RetryStrategy(None, jitter="full"), "jitter")
    _refused(lambda: grpc.A6RetryStrategy(None, transparent_retry_limit=None), "transparent")
    _refused(lambda: grpc.retry_controller("x"), "insecure_channel")
    _refused(lambda: grpc.retry_stats(None), "insecure_channel")
    _refused(lambda: grpc.parse_duration(None), "duration")
    _refused(lambda: grpc.HedgingPolicy(None), "max_attempts")
    _refused(lambda: grpc.RetryController("t", enabled="x"), "enabled")


# --- live objects: a refused call leaves them as they were -----------------------------------


def test_orchestrator_and_request_are_unchanged_by_refused_calls() -> None:
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: 0.0))
    request = Request(idempotent=True)
    bad: list[tuple[str, Call]] = [
        ("reason", lambda: orchestrator.maybe_retry(request, "KV_LOCKED")),
        ("cause", lambda: orchestrator.maybe_retry(request, KL, cause="x")),
        ("effect", lambda: orchestrator.maybe_retry(request, KL, effect="NOT_SENT")),
        ("retry_after", lambda: orchestrator.maybe_retry(request, KL, retry_after=[1])),
        ("error", lambda: orchestrator.fail(request, ValueError)),
        ("policy", lambda: orchestrator.hedge(request, _async_hedge_send, "x")),
        ("send", lambda: orchestrator.execute(request, "x")),
        ("send", lambda: orchestrator.execute_sync(request, None)),
    ]
    for named, call in bad:
        _refused(call, named)
        assert request.state is RequestState.PENDING, named
        assert request.retry_attempts == 0, named
        assert orchestrator.requests_in_retry == 0, named
    assert asyncio.run(orchestrator.maybe_retry(request, KL)) == timedelta(0)
    assert request.retry_attempts == 1
    assert asyncio.run(orchestrator.execute(Request(idempotent=True), _async_send)) == "ok"


def test_breaker_throttle_limiter_quantile_unchanged_by_refused_calls() -> None:
    breaker = CircuitBreaker()
    breaker.record_failure(TimeoutError())
    before = breaker.counts
    bad: object  # each loop below passes values of several wrong types
    for bad in (None, "x", ValueError, 5):
        _refused(lambda bad=bad: breaker.record_failure(bad), "record_failure(error)")  # type: ignore[misc]
        _refused(
            lambda bad=bad: breaker.guard(bad) if bad is not None else breaker.guard(5),  # type: ignore[misc]
            "guard",
        )
    assert breaker.counts == before
    breaker.record_failure(TimeoutError())
    assert breaker.counts != before

    throttle = AdaptiveThrottle()
    shown = repr(throttle)
    for bad in (None, "x", ValueError):
        _refused(lambda bad=bad: throttle.record_failure(bad), "record_failure(error)")  # type: ignore[misc]
    assert repr(throttle) == shown
    assert throttle.admit() is True

    quantile = LatencyQuantile(min_samples=1)
    shown = repr(quantile)
    for bad in (None, "1", -1, float("nan"), True, [1]):
        _refused(lambda bad=bad: quantile.record(bad), "record(latency)")  # type: ignore[misc]
    assert repr(quantile) == shown
    quantile.record(0.01)
    assert repr(quantile) != shown

    limiter = ConcurrencyLimiter(1)

    async def hold() -> str:
        async with limiter.acquire():
            return repr(limiter)

    assert "in_flight=1" in asyncio.run(hold())
    assert "in_flight=0" in repr(limiter)


REPORTER_BAD: list[Any] = [
    pytest.param("service", (None, "get", 1.0), {}, id="service=None"),
    pytest.param("service", (5, "get", 1.0), {}, id="service=int"),
    pytest.param("operation_name", ("kv", None, 1.0), {}, id="operation_name=None"),
    pytest.param("operation_name", ("kv", 5, 1.0), {}, id="operation_name=int"),
    pytest.param("duration", ("kv", "get", None), {}, id="duration=None"),
    pytest.param("duration", ("kv", "get", "1"), {}, id="duration=str"),
    pytest.param("duration", ("kv", "get", -1), {}, id="duration=-1"),
    pytest.param("duration", ("kv", "get", float("nan")), {}, id="duration=nan"),
    pytest.param("duration", ("kv", "get", 10**400), {}, id="duration=1e400"),
    pytest.param("duration", ("kv", "get", True), {}, id="duration=bool"),
    pytest.param("operation_id", ("kv", "get", 9.0), {"operation_id": 5}, id="operation_id=int"),
    pytest.param("timeout", ("kv", "get", 9.0), {"timeout": "1"}, id="timeout=str"),
    pytest.param("timeout", ("kv", "get", 9.0), {"timeout": 10**400}, id="timeout=1e400"),
    pytest.param("last_remote_socket", ("kv", "get", 9.0), {"last_remote_socket": 5}, id="sock"),
    pytest.param("encode_duration", ("kv", "get", 9.0), {"encode_duration": -1}, id="encode=-1"),
    pytest.param(
        "total_server_duration",
        ("kv", "get", 9.0),
        {"total_server_duration": float("nan")},
        id="server=nan",
    ),
]


@pytest.mark.parametrize("kind", [ThresholdReporter, OrphanReporter])
@pytest.mark.parametrize(("named", "args", "kwargs"), REPORTER_BAD)
def test_reporter_record_refuses_and_keeps_its_samples(
    kind: type, named: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    reporter = kind(clock=lambda: 0.0)
    _refused(lambda: reporter.record(*args, **kwargs), f"{kind.__name__}.record({named})")
    assert reporter.flush() is None  # nothing half-recorded
    reporter.record("kv", "get", 9.0)
    report = reporter.flush()
    assert report is not None
    assert "get" in repr(report)


# --- accepted on purpose (documented leniency; pinned so a change is noticed) ---------------


def test_accepted_values_stay_accepted_and_print() -> None:
    for built in (
        Request(name=""),  # an empty name is a name
        RetryBudget(name=""),
        CircuitBreaker(name=""),
        RetryableError(KL, None),
        RetryBudget(retry_ratio=2),  # in [0, 1000]
        m.parse_retry_after(""),  # an unparseable header is "no hint", per RFC 9110
        t.Delay(1, then=5),  # then is any script step: a value is one
    ):
        repr(built)
        str(built)


# ============================================================================================
# BUGS: what the sweep found wrong, each fixed since.
# ============================================================================================


def _bug_vclock_sleep(value: object) -> object:
    clock = t.VirtualClock()
    before = (clock.clock(), len(clock.sleeps))
    error: TypeError | ValueError | None = None
    try:
        asyncio.run(clock.sleep(value))
    except (TypeError, ValueError) as exc:  # judged below
        error = exc
    assert (clock.clock(), len(clock.sleeps)) == before, (
        f"state changed: {clock.clock()!r}, {clock.sleeps!r}"
    )
    if error is not None:
        raise error
    raise AssertionError(f"VirtualClock.sleep({value!r}) accepted; clock now {clock.clock()!r}")


def _bug_sync_sleep_is_async() -> object:
    count = {"n": 0}

    def flaky(request: Request) -> str:
        count["n"] += 1
        if count["n"] < 2:
            raise RetryableError(KL)
        return "ok"

    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    return orchestrator.execute_sync(Request(idempotent=True), flaky, sleep=_async_sleep)


def _bug_execute_with_sync_sleep() -> object:
    count = {"n": 0}

    async def flaky(request: Request) -> str:
        count["n"] += 1
        if count["n"] < 2:
            raise RetryableError(KL)
        return "ok"

    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=lambda seconds: None)  # type: ignore[return-value]
    return asyncio.run(orchestrator.execute(Request(idempotent=True), flaky))


def _bug_secure_channel(credentials: object) -> object:
    grpc = _grpc()

    async def build() -> object:
        channel = grpc.secure_channel("localhost:1", credentials)
        await channel.close()
        return channel

    return asyncio.run(build())


BUGS: list[Any] = [
    # sdkcore core
    _case("request", lambda: _orch().succeed(None), "succeed(request=None)"),
    _case("request", lambda: _orch().succeed("x"), "succeed(request=str)"),
    _case("request", lambda: _orch().fail(None, ValueError()), "fail(request=None)"),
    _case("retry_budget", lambda: RetryOrchestrator(retry_budget=RetryBudget), "Orch(budget=cls)"),
    _case("sleep", _bug_execute_with_sync_sleep, "Orchestrator(sleep=sync)"),
    _case("sleep", _bug_sync_sleep_is_async, "execute_sync(sleep=async)"),
    _case(
        "sleep",
        lambda: _orch().execute_sync(_req(), _sync_send, sleep=None),
        "execute_sync(sleep=None)",
    ),
    _case(
        "send",
        lambda: _orch().hedge(_req(), lambda request, index: "ok", HedgePolicy(2)),  # type: ignore[return-value]
        "hedge(send=sync)",
    ),
    _case("clock", lambda: Request(clock=None), "Request(clock=None)"),
    _case("clock", lambda: Request(clock=5), "Request(clock=int)"),
    _case("clock", lambda: Request(clock=_async_clock), "Request(clock=async)"),
    _case("clock", lambda: RetryBudget(clock=_async_clock), "RetryBudget(clock=async)"),
    _case("clock", lambda: CircuitBreaker(clock=_async_clock), "CB(clock=async)"),
    _case(
        "is_failure", lambda: CircuitBreaker(is_failure=_async_predicate), "CB(is_failure=async)"
    ),
    _case("sleep_window", lambda: CircuitBreaker(sleep_window=5000), "CB(sleep_window=5000 ms)"),
    _case("canary_timeout", lambda: CircuitBreaker(canary_timeout=5000), "CB(canary=5000 ms)"),
    _case("clock", lambda: ConcurrencyLimiter(1, clock=_async_clock), "Limiter(clock=async)"),
    _case("backoff", lambda: BestEffortRetryStrategy(backoff=_async_send), "BestEffort(b=async)"),
    _case("lower", lambda: exponential_backoff(1e-310, 1.0, 1e6), "exponential_backoff(1e-310)"),
    _case("attempt", lambda: exponential_backoff()(None), "exponential_backoff()(None)"),
    _case("attempt", lambda: exponential_backoff()("3"), "exponential_backoff()(str)"),
    _case("attempt", lambda: exponential_backoff()(1.5), "exponential_backoff()(1.5)"),
    _case("attempt", lambda: exponential_backoff()(True), "exponential_backoff()(bool)"),
    _case("attempt", lambda: best_effort_backoff(None), "best_effort_backoff(None)"),
    _case("attempt", lambda: best_effort_backoff(1.5), "best_effort_backoff(1.5)"),
    _case("attempt", lambda: best_effort_backoff(True), "best_effort_backoff(bool)"),
    _case("request", lambda: BestEffortRetryStrategy().decide(None, KL), "decide(request=None)"),
    _case("reason", lambda: BestEffortRetryStrategy().decide(_req(), None), "decide(reason=None)"),
    _case("reason", lambda: BestEffortRetryStrategy().decide(_req(), "x"), "decide(reason=str)"),
    _case("error", lambda: describe_error("x"), "describe_error(str)"),
    _case("error", lambda: describe_error(ValueError), "describe_error(class)"),
    _case("message", lambda: str(CouchbaseException(5)), "CouchbaseException(message=int)"),
    _case("context", lambda: CouchbaseException("m", context="x"), "CouchbaseException(ctx=str)"),
    _case("reason", lambda: repr(_req().error_context("x")), "error_context(reason=str)"),
    _case("extra", lambda: _req().error_context(extra=[1]), "error_context(extra=list)"),
    _case("effect", lambda: sdkcore.AttemptRecord(1, None, "x"), "AttemptRecord(effect=str)"),
    _case("threshold(service)", lambda: ThresholdReporter().threshold(None), "threshold(None)"),
    _case("threshold(service)", lambda: ThresholdReporter().threshold(5), "threshold(int)"),
    # sdkcore.mapping
    _case("error_map", lambda: m.kv_retry_reason(1, 0, {}), "kv_retry_reason(error_map=dict)"),
    _case("error_map", lambda: m.kv_failure(1, 0, "x"), "kv_failure(error_map=str)"),
    _case("error_map", lambda: m.kv_exception(1, 0, error_map=5), "kv_exception(error_map=int)"),
    _case("with_cas", lambda: m.kv_failure(1, 0, with_cas="x"), "kv_failure(with_cas=str)"),
    _case("context", lambda: m.kv_exception(1, 0, context=5), "kv_exception(context=int)"),
    _case("context", lambda: m.grpc_failure(14, context="x"), "grpc_failure(context=str)"),
    _case("request", lambda: m.raise_failure(KL, request="x"), "raise_failure(request=str)"),
    _case("errors", lambda: m.ErrorMap(1, 0, None), "ErrorMap(errors=None)"),
    _case("errors", lambda: m.ErrorMap(1, 0, [1]), "ErrorMap(errors=list)"),
    _case("errors", lambda: m.ErrorMap(1, 0, {1: "x"}), "ErrorMap(errors={1: str})"),  # type: ignore[dict-item]
    _case("attrs", lambda: m.ErrorCode(1, "N", "d", "x"), "ErrorCode(attrs=str)"),
    _case("attrs", lambda: m.ErrorCode(1, "N", "d", None), "ErrorCode(attrs=None)"),
    _case("retry", lambda: m.ErrorCode(1, "N", "d", frozenset(), retry="x"), "ErrorCode(retry=s)"),
    # sdkcore.testing
    _case("ScriptedSend(script)", lambda: t.ScriptedSend(None), "ScriptedSend(None)"),
    _case("ScriptedSend(script)", lambda: t.ScriptedSend(5), "ScriptedSend(int)"),
    _case("seconds", lambda: _bug_vclock_sleep("1"), "VirtualClock.sleep(str)"),
    _case("seconds", lambda: _bug_vclock_sleep(None), "VirtualClock.sleep(None)"),
    _case("seconds", lambda: _bug_vclock_sleep(float("nan")), "VirtualClock.sleep(nan)"),
    _case("seconds", lambda: _bug_vclock_sleep(-1), "VirtualClock.sleep(-1)"),
]


@pytest.mark.parametrize(("named", "call"), BUGS)
def test_bug_bad_input_is_refused_naming_the_field(named: str, call: Call) -> None:
    _refused(call, named)


@pytest.mark.parametrize("kind", [ThresholdReporter, OrphanReporter])
def test_bug_reporter_sample_size_past_the_int_str_limit(kind: type) -> None:
    # accepted today, and then its repr raises CPython's "Exceeds the limit" ValueError
    judge(lambda v: kind(sample_size=v), 10**5000, named="sample_size")


BUGS_GRPC: list[Any] = [
    pytest.param(
        "orchestrator", lambda: _channel(orchestrator="x"), id="channel(orchestrator=str)"
    ),
    pytest.param(
        "orchestrator", lambda: _channel(orchestrator=RetryOrchestrator), id="channel(orch=class)"
    ),
    pytest.param(
        "message_size", lambda: _channel(message_size=_async_send), id="message_size=async"
    ),
    pytest.param("target", lambda: _channel(target=""), id="channel(target='')"),
    pytest.param("compression", lambda: _channel(compression="gzip"), id="compression=str"),
    pytest.param("credentials", lambda: _bug_secure_channel("x"), id="secure_channel(creds=str)"),
    pytest.param("credentials", lambda: _bug_secure_channel(None), id="secure_channel(creds=None)"),
]


@pytest.mark.parametrize(("named", "call"), BUGS_GRPC)
def test_bug_channel_keyword_is_refused_naming_it(named: str, call: Call) -> None:
    _grpc()
    _refused(call, named)


def test_bug_grpc_helpers() -> None:
    grpc = _grpc()
    failures = []
    for named, call in [
        ("policy", lambda: grpc.A6RetryStrategy("x")),
        ("rng", lambda: grpc.A6RetryStrategy(None, rng=5)),
        ("throttler", lambda: grpc.A6RetryStrategy(None, throttler="x")),
        ("error", lambda: grpc.call_context("x")),
        ("error_or_metadata", lambda: grpc.previous_rpc_attempts(5)),
        ("values", lambda: grpc.parse_pushback(None)),
        ("method", lambda: grpc.RetryStats().record_retry(None, 1)),
        ("retry_number", lambda: grpc.RetryStats().record_retry("m", "1")),
        ("method", lambda: grpc.RetryStats().for_method(None)),
        ("full_method", lambda: grpc.ServiceConfig().method_config(None)),
        ("service", lambda: grpc.MethodName(None)),
    ]:
        try:
            _refused(call, named)
        except BaseException as exc:  # collect them all: one line each in the failure
            failures.append(f"{named}: {type(exc).__name__}: {str(exc)[:150]}")
    assert not failures, "\n".join(failures)


# Real credentials build a TLS channel that works: tests/grpc_a6/test_grpc_tls.py.


#: What takes a clock and reads it where it is given: (its field, how to make one).
_CLOCK_OWNERS = [
    ("ConcurrencyLimiter(clock)", lambda clock: sdkcore.ConcurrencyLimiter(2, clock=clock)),
    (
        "AdaptiveConcurrencyLimiter(clock)",
        lambda clock: sdkcore.AdaptiveConcurrencyLimiter(clock=clock),
    ),
    ("AdaptiveThrottle(clock)", lambda clock: sdkcore.AdaptiveThrottle(clock=clock)),
    ("LatencyQuantile(clock)", lambda clock: sdkcore.LatencyQuantile(clock=clock)),
    ("RetryBudget(clock)", lambda clock: sdkcore.RetryBudget(clock=clock)),
    ("CircuitBreaker(clock)", lambda clock: sdkcore.CircuitBreaker(clock=clock)),
]


@pytest.mark.parametrize("reading", [None, "12.5", True])
@pytest.mark.parametrize(
    ("what", "make"),
    _CLOCK_OWNERS,
)
def test_a_clock_that_returns_no_seconds_is_refused_where_it_is_given(
    what: str, make: Any, reading: object
) -> None:
    """It failed later, inside arithmetic (``unsupported operand type(s) for *:
    'NoneType' and 'float'``), naming neither the clock nor its owner."""
    with pytest.raises(TypeError, match=re.escape(what) + r" must return seconds"):
        make(lambda: reading)


@pytest.mark.parametrize("reading", [math.nan, math.inf, -math.inf, 10**400, -(10**400)])
@pytest.mark.parametrize(
    ("what", "make"),
    _CLOCK_OWNERS,
)
def test_a_clock_that_returns_no_finite_seconds_is_refused_where_it_is_given(
    what: str, make: Any, reading: float
) -> None:
    """NaN or an infinity: the throttle and the quantile raised ``cannot convert float NaN
    to integer`` (or an OverflowError), naming nothing; the limiters took it, and the
    adaptive one never adapted."""
    with pytest.raises(ValueError, match=re.escape(what) + r" must return finite seconds"):
        make(lambda: reading)


def test_messages_say_which_numbers_and_give_timeout_advice_to_timeouts_only() -> None:
    """A Fraction is a real number, yet refused as "not a real number"; a window too long
    for a timedelta was told "a timeout can be None for no deadline"."""
    from fractions import Fraction

    with pytest.raises(TypeError, match=r"AdaptiveThrottle\(k\) must be an int or float"):
        AdaptiveThrottle(Fraction(3, 2))
    with pytest.raises(TypeError, match=r"max_extra_load\) must be an int or float"):
        LatencyQuantile(Fraction(1, 100))
    with pytest.raises(ValueError, match=r"AdaptiveThrottle\(window\)") as window:
        AdaptiveThrottle(window=timedelta.max)
    assert "timeout" not in str(window.value)
    with pytest.raises(ValueError, match=r"a timeout can be None for no deadline"):
        Request(timeout=10**20)
