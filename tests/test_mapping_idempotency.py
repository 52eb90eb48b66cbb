"""Idempotent operation list, Request factories, and connection-stage reasons."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sdkcore import (
    BestEffortRetryStrategy,
    CasMismatchException,
    Request,
    RetryableError,
    RetryReason,
)
from sdkcore.mapping import (
    IDEMPOTENT_KV_OPCODES,
    FailureStage,
    HttpService,
    KvOpcode,
    dispatch_failure_reason,
    http_request,
    is_idempotent_http,
    is_idempotent_kv,
    kv_request,
    raise_failure,
    retry_allowed,
)

IDEMPOTENT = {
    KvOpcode.GET,
    KvOpcode.GET_REPLICA,
    KvOpcode.GET_META,
    KvOpcode.SUBDOC_GET,
    KvOpcode.SUBDOC_EXISTS,
    KvOpcode.SUBDOC_GET_COUNT,
    KvOpcode.SUBDOC_MULTI_LOOKUP,
    KvOpcode.NOOP,
    KvOpcode.OBSERVE,
    KvOpcode.OBSERVE_SEQNO,
    KvOpcode.GET_COLLECTION_ID,
    KvOpcode.GET_COLLECTIONS_MANIFEST,
    KvOpcode.GET_CLUSTER_CONFIG,
}


@pytest.mark.parametrize("opcode", list(KvOpcode), ids=lambda op: op.name)
def test_kv_idempotency_is_exactly_the_rfc_list(opcode: KvOpcode) -> None:
    assert is_idempotent_kv(opcode) is (opcode in IDEMPOTENT)
    assert kv_request(opcode).idempotent is (opcode in IDEMPOTENT)


def test_the_rfc_exclusions() -> None:
    for op in (
        KvOpcode.GET_AND_LOCK,
        KvOpcode.GET_AND_TOUCH,
        KvOpcode.SET,
        KvOpcode.SUBDOC_MULTI_MUTATION,
    ):
        assert not is_idempotent_kv(op)
    assert frozenset(IDEMPOTENT) == IDEMPOTENT_KV_OPCODES


# RFC 0049's idempotent KV operations as wire opcodes, written out independently of KvOpcode:
# Get, GetReplica, GetMeta, SubdocGet, SubdocExists, SubdocGetCount, SubdocMultiLookup, Noop,
# Observe, ObserveSeqno, GetCollectionID, GetCollectionsManifest, GetClusterConfig.
IDEMPOTENT_WIRE_OPCODES = [
    0x00, 0x83, 0xA0, 0xC5, 0xC6, 0xD2, 0xD0, 0x0A, 0x92, 0x91, 0xBB, 0xBA, 0xB5,
]  # fmt: skip


def test_unknown_opcodes_are_not_idempotent() -> None:
    # Every one of the 256 opcodes, against the list written above (not the module's set).
    for opcode in range(0x100):
        expected = opcode in IDEMPOTENT_WIRE_OPCODES
        assert is_idempotent_kv(opcode) is expected, hex(opcode)
        assert kv_request(opcode).idempotent is expected, hex(opcode)


def test_idempotent_wire_opcodes_match_the_named_list() -> None:
    assert sorted(IDEMPOTENT_WIRE_OPCODES) == sorted(op.value for op in IDEMPOTENT)
    assert frozenset(IDEMPOTENT_WIRE_OPCODES) == IDEMPOTENT_KV_OPCODES


@pytest.mark.parametrize(
    ("opcode", "error", "match"),
    [
        ("get", TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
        (256, ValueError, "0..0xff"),
    ],
)
def test_bad_opcodes(opcode: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        is_idempotent_kv(opcode)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        kv_request(opcode)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("service", "method", "readonly", "expected"),
    [
        (HttpService.QUERY, "POST", True, True),
        (HttpService.QUERY, "POST", False, False),
        ("analytics", "POST", True, True),
        ("ANALYTICS", "post", False, False),
        (HttpService.SEARCH, "POST", False, True),
        (HttpService.VIEWS, "GET", False, True),
        (HttpService.MANAGEMENT, "GET", False, True),
        (HttpService.MANAGEMENT, "get", False, True),
        (HttpService.MANAGEMENT, "POST", False, False),
        (HttpService.MANAGEMENT, "PUT", False, False),
        (HttpService.MANAGEMENT, "DELETE", False, False),
    ],
)
def test_http_idempotency(
    service: HttpService | str, method: str, readonly: bool, expected: bool
) -> None:
    assert is_idempotent_http(service, method, readonly=readonly) is expected
    request = http_request(service, method, readonly=readonly)
    assert request.idempotent is expected


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("kv", "GET"), {}, ValueError, "must be an HttpService or one of"),
        (("query", "FETCH"), {}, ValueError, "must be one of DELETE, GET"),
        (("query", 3), {}, TypeError, "HTTP method string"),
        (("management", "POST"), {"readonly": True}, ValueError, "applies to query and analytics"),
        (("query", "POST"), {"readonly": "yes"}, TypeError, "must be a bool"),
    ],
)
def test_http_bad_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        is_idempotent_http(*args, **kwargs)


def test_factories_pass_request_arguments_and_refuse_idempotent() -> None:
    strategy = BestEffortRetryStrategy()
    request = kv_request(KvOpcode.SET, timeout=1.5, retry_strategy=strategy)
    assert isinstance(request, Request)
    assert request.name == "kv.set"
    assert request.timeout == timedelta(seconds=1.5)
    assert request.retry_strategy is strategy
    assert not request.idempotent
    assert kv_request(0x42).name == "kv.0x42"
    assert kv_request(KvOpcode.GET, name="custom").name == "custom"
    assert http_request("search", "POST").name == "search.post"
    with pytest.raises(TypeError, match="do not pass idempotent="):
        kv_request(KvOpcode.GET, idempotent=False)
    with pytest.raises(TypeError, match="do not pass idempotent="):
        http_request("query", "POST", idempotent=True)


# -- stages ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "reason"),
    [
        (FailureStage.NODE_NOT_AVAILABLE, RetryReason.NODE_NOT_AVAILABLE),
        (FailureStage.SERVICE_NOT_AVAILABLE, RetryReason.SERVICE_NOT_AVAILABLE),
        (FailureStage.CIRCUIT_BREAKER_OPEN, RetryReason.CIRCUIT_BREAKER_OPEN),
        (FailureStage.SOCKET_NOT_AVAILABLE, RetryReason.SOCKET_NOT_AVAILABLE),
        (FailureStage.IN_FLIGHT, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT),
    ],
)
def test_stage_reasons(stage: FailureStage, reason: RetryReason) -> None:
    assert dispatch_failure_reason(stage) is reason
    # Not written -> safe for anything; written -> idempotent requests only.
    assert retry_allowed(reason, idempotent=True)
    assert retry_allowed(reason, idempotent=False) is (not stage.written)
    assert reason.after_dispatch is stage.written


def test_stage_bad_input() -> None:
    with pytest.raises(TypeError, match="must be a FailureStage"):
        dispatch_failure_reason("in_flight")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a RetryReason"):
        retry_allowed("KV_LOCKED", idempotent=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a bool"):
        retry_allowed(RetryReason.KV_LOCKED, idempotent=1)  # type: ignore[arg-type]


def test_raise_failure() -> None:
    cause = OSError("reset")
    with pytest.raises(RetryableError) as info:
        raise_failure(RetryReason.KV_LOCKED, cause=cause)
    assert info.value.reason is RetryReason.KV_LOCKED
    assert info.value.__cause__ is cause
    with pytest.raises(CasMismatchException) as exc_info:
        raise_failure(CasMismatchException(), cause=cause)
    assert exc_info.value.__cause__ is cause
    with pytest.raises(TypeError, match="RetryReason or an exception"):
        raise_failure(None)  # type: ignore[arg-type]
