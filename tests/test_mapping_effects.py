"""What every mapper records about the server side of a failed attempt (rfc/0002 "Attempt effect").

The rule: a server answer that by its protocol proves nothing was applied is NOT_APPLIED;
anything else that reached the server is MAYBE_APPLIED; NOT_SENT is only for what never
left the client. The effect a mapper's result is recorded with is what
``raise_failure`` hands the orchestrator: the RetryableError's own ``effect``, or the
reason's default (``AttemptEffect.for_reason``).
"""

from __future__ import annotations

import pytest

from sdkcore import AttemptEffect, RetryableError, RetryReason
from sdkcore.mapping import (
    ErrorMap,
    FailureStage,
    GrpcCode,
    KvOpcode,
    KvStatus,
    analytics_retry_reason,
    dispatch_failure_reason,
    grpc_failure,
    kv_exception,
    kv_failure,
    query_retry_reason,
    raise_failure,
    search_retry_reason,
    views_retry_reason,
)


def recorded_effect(result: object) -> AttemptEffect | None:
    """The effect ``raise_failure(result)`` hands the orchestrator (None: not a retry)."""
    try:
        raise_failure(result)  # type: ignore[arg-type]
    except RetryableError as failure:
        return failure.effect or AttemptEffect.for_reason(failure.reason)
    except Exception:
        return None
    raise AssertionError("raise_failure returned")  # pragma: no cover


ERROR_MAP = ErrorMap.from_json(
    '{"version": 2, "revision": 1, "errors": {"7ff": {"name": "X", "desc": "x", '
    '"attrs": ["retry-now"], "retry": {"strategy": "constant", "interval": 1, "after": 0}}}}'
)


def test_kv_answers_are_never_not_sent() -> None:
    seen = set()
    for status in range(1, 0x100):
        for opcode in (KvOpcode.GET, KvOpcode.SET, KvOpcode.UNLOCK, KvOpcode.GET_COLLECTION_ID):
            effect = recorded_effect(kv_failure(status, opcode, ERROR_MAP))
            if effect is not None:
                # A KV error status means the server did not perform the operation.
                assert effect is AttemptEffect.NOT_APPLIED, (hex(status), opcode)
                seen.add(status)
    assert {0x07, 0x09, 0x86, 0x85, 0x88, 0xA2, 0xA4} <= seen
    assert recorded_effect(kv_failure(0x7FF, KvOpcode.SET, ERROR_MAP)) is AttemptEffect.NOT_APPLIED


def test_http_answers_are_never_not_sent() -> None:
    results = [
        query_retry_reason([{"code": code, "msg": "queryport.indexNotFound", "retry": True}])
        for code in (4040, 4050, 4070, 5000, 17013, 1080)
    ]
    results += [analytics_retry_reason([{"code": c}]) for c in (23000, 23003, 23007)]
    results += [search_retry_reason(s) for s in range(100, 600)]
    results += [views_retry_reason(s) for s in range(100, 600)]
    effects = [recorded_effect(r) for r in results if r is not None]
    assert len(effects) > 10
    assert set(effects) == {AttemptEffect.NOT_APPLIED}


@pytest.mark.parametrize("code", [c for c in GrpcCode if c is not GrpcCode.OK])
def test_grpc_statuses_received_from_a_server_are_never_not_sent(code: GrpcCode) -> None:
    effect = recorded_effect(grpc_failure(code, "from the server"))
    if code is GrpcCode.UNAVAILABLE:
        assert effect is AttemptEffect.MAYBE_APPLIED
    else:
        assert effect is None  # completes the request: no retry, nothing recorded


def test_grpc_locked_violation_is_not_applied() -> None:
    detail = {
        "@type": "type.googleapis.com/google.rpc.PreconditionFailure",
        "violations": [{"type": "LOCKED"}],
    }
    for code in (GrpcCode.FAILED_PRECONDITION, GrpcCode.UNAVAILABLE):
        assert recorded_effect(grpc_failure(code, "", [detail])) is AttemptEffect.NOT_APPLIED


@pytest.mark.parametrize("stage", list(FailureStage))
def test_only_failures_before_the_write_are_not_sent(stage: FailureStage) -> None:
    effect = recorded_effect(dispatch_failure_reason(stage))
    if stage.written:
        assert effect is AttemptEffect.MAYBE_APPLIED
    else:
        assert effect is AttemptEffect.NOT_SENT


def test_raise_failure_takes_an_explicit_effect_for_a_reason() -> None:
    with pytest.raises(RetryableError) as info:
        raise_failure(
            RetryReason.SERVICE_RESPONSE_CODE_INDICATED, effect=AttemptEffect.MAYBE_APPLIED
        )
    assert info.value.effect is AttemptEffect.MAYBE_APPLIED
    with pytest.raises(RetryableError) as default:
        raise_failure(RetryReason.KV_LOCKED)
    assert default.value.effect is None  # the reason's default applies


def test_raise_failure_effect_is_checked() -> None:
    with pytest.raises(TypeError, match=r"raise_failure\(effect\) must be an AttemptEffect"):
        raise_failure(RetryReason.KV_LOCKED, effect="maybe_applied")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"raise_failure\(effect\) applies to a RetryReason"):
        raise_failure(ValueError("x"), effect=AttemptEffect.NOT_APPLIED)


def test_raise_failure_chains_the_cause_of_a_mapped_retryable_error() -> None:
    cause = OSError("status from the wire")
    with pytest.raises(RetryableError) as info:
        raise_failure(grpc_failure("UNAVAILABLE"), cause=cause)
    assert info.value.__cause__ is cause
    assert info.value.effect is AttemptEffect.MAYBE_APPLIED


def test_a_kv_error_answer_proves_nothing_changed_unless_ambiguous() -> None:
    """The server answered with an error status: the command changed nothing (all or
    nothing), so the final answer's effect is NOT_APPLIED; a durable write whose outcome
    is unknown, and a status sdkcore does not know, say nothing (maybe applied)."""
    exists = kv_exception(KvStatus.KEY_EXISTS, KvOpcode.ADD)
    assert exists.effect is AttemptEffect.NOT_APPLIED
    assert (
        kv_exception(KvStatus.KEY_NOT_FOUND, KvOpcode.REPLACE).effect is AttemptEffect.NOT_APPLIED
    )
    assert kv_exception(KvStatus.SYNC_WRITE_AMBIGUOUS, KvOpcode.SET).effect is None
    assert kv_exception(0x7F01, KvOpcode.SET).effect is None  # unknown


def test_a_couchbase_exceptions_effect_survives_pickling_and_only_an_effect_counts() -> None:
    """``effect`` is a plain attribute (a subclass may have its own ``effect``: anything
    but an AttemptEffect is booked maybe applied, never breaks the request)."""
    import pickle

    from sdkcore import CouchbaseException
    from sdkcore._errors import final_effect

    error = CouchbaseException("refused")
    assert error.effect is None
    assert final_effect(error, 1) is AttemptEffect.MAYBE_APPLIED
    error.effect = AttemptEffect.NOT_APPLIED
    assert pickle.loads(pickle.dumps(error)).effect is AttemptEffect.NOT_APPLIED
    assert final_effect(error, 1) is AttemptEffect.NOT_APPLIED

    class PolicyDenied(CouchbaseException):
        effect = "deny"  # type: ignore[assignment]  # the application's own meaning

    assert final_effect(PolicyDenied("no"), 1) is AttemptEffect.MAYBE_APPLIED


def test_a_kv_status_that_does_not_prove_nothing_changed_says_nothing() -> None:
    assert kv_exception(KvStatus.INTERNAL_ERROR, KvOpcode.SET).effect is None
    assert kv_exception(KvStatus.NOT_STORED, KvOpcode.APPEND).effect is None  # plain
    assert kv_exception(KvStatus.NOT_STORED, KvOpcode.ADD).effect is AttemptEffect.NOT_APPLIED
