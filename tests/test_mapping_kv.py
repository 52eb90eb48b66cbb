"""KV status/opcode -> RetryReason and exception (RFC 0049 "Response Code Retry List", KV)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdkcore import (
    AttemptEffect,
    AuthenticationFailureException,
    CasMismatchException,
    CollectionNotFoundException,
    CouchbaseException,
    DocumentExistsException,
    DocumentLockedException,
    DocumentNotFoundException,
    FeatureNotAvailableException,
    InternalServerFailureException,
    InvalidArgumentException,
    QuotaLimitedException,
    RateLimitedException,
    Request,
    RetryOrchestrator,
    RetryReason,
    ScopeNotFoundException,
    TemporaryFailureException,
)
from sdkcore.mapping import (
    DCP_OPCODES,
    KV_RETRY_STATUSES,
    BucketNotFoundException,
    DocumentNotLockedException,
    DurabilityAmbiguousException,
    ErrorMap,
    KvOpcode,
    KvStatus,
    ValueTooLargeException,
    kv_exception,
    kv_failure,
    kv_request,
    kv_retry_reason,
    raise_failure,
)
from sdkcore.testing import VirtualClock

R = RetryReason
NON_DCP_OPCODES = [op for op in KvOpcode if op not in DCP_OPCODES]
DCP = sorted(DCP_OPCODES)

# (status, reason) rows of the RFC table, before per-opcode exceptions.
ROWS = [
    (0x07, R.KV_NOT_MY_VBUCKET),
    (0x88, R.KV_COLLECTION_OUTDATED),
    (0x09, R.KV_LOCKED),
    (0x86, R.KV_TEMPORARY_FAILURE),
    (0x85, R.KV_TEMPORARY_FAILURE),
    (0xA2, R.KV_SYNC_WRITE_IN_PROGRESS),
    (0xA4, R.KV_SYNC_WRITE_RE_COMMIT_IN_PROGRESS),
]
# (status, opcode) pairs the RFC takes out of the table.
EXCLUDED = {(0x88, 0xBB), (0x09, 0x95)}


def error_map(entries: dict[int, list[str]]) -> ErrorMap:
    doc = {
        "version": 2,
        "revision": 1,
        "errors": {
            f"{code:x}": {"name": f"E{code:x}", "desc": f"status {code:x}", "attrs": attrs}
            for code, attrs in entries.items()
        },
    }
    return ErrorMap.from_json(json.dumps(doc))


def test_table_constant_matches_the_rfc_rows() -> None:
    assert dict(KV_RETRY_STATUSES) == dict(ROWS)


@pytest.mark.parametrize(("status", "reason"), ROWS)
@pytest.mark.parametrize("opcode", NON_DCP_OPCODES, ids=lambda op: op.name)
def test_rfc_rows_on_every_non_dcp_opcode(status: int, reason: RetryReason, opcode: int) -> None:
    expected = None if (status, opcode) in EXCLUDED else reason
    assert kv_retry_reason(status, opcode) is expected


@pytest.mark.parametrize(("status", "reason"), ROWS)
@pytest.mark.parametrize("opcode", DCP, ids=hex)
def test_dcp_opcodes_are_excluded(status: int, reason: RetryReason, opcode: int) -> None:
    assert kv_retry_reason(status, opcode) is None


def test_dcp_opcodes_are_0x50_to_0x68_and_named() -> None:
    assert frozenset(range(0x50, 0x69)) == DCP_OPCODES
    assert {op.value for op in KvOpcode if op.name.startswith("DCP_")} == DCP_OPCODES
    # The cache-transfer messages kv_engine added after OsoSnapshot (0x65).
    assert KvOpcode.DCP_CACHED_VALUE == 0x66  # type: ignore[comparison-overlap]  # IntEnum == int (python/mypy#16327)
    assert KvOpcode.DCP_CACHED_KEY_META == 0x67  # type: ignore[comparison-overlap]
    assert KvOpcode.DCP_CACHE_TRANSFER_END == 0x68  # type: ignore[comparison-overlap]
    assert KvOpcode.DCP_CACHE_TRANSFER_END.is_dcp
    assert KvOpcode.DCP_MUTATION.is_dcp
    assert not KvOpcode.GET.is_dcp


def test_get_collection_id_unknown_collection_is_not_retried_but_collection_not_found() -> None:
    assert kv_retry_reason(KvStatus.UNKNOWN_COLLECTION, KvOpcode.GET_COLLECTION_ID) is None
    exc = kv_failure(KvStatus.UNKNOWN_COLLECTION, KvOpcode.GET_COLLECTION_ID)
    assert type(exc) is CollectionNotFoundException
    # On a data operation it is an outdated collection id: retried.
    assert kv_retry_reason(KvStatus.UNKNOWN_COLLECTION, KvOpcode.GET) is R.KV_COLLECTION_OUTDATED


def test_locked_on_unlock_is_cas_mismatch_not_retry() -> None:
    assert kv_retry_reason(KvStatus.LOCKED, KvOpcode.UNLOCK) is None
    exc = kv_failure(KvStatus.LOCKED, KvOpcode.UNLOCK)
    assert type(exc) is CasMismatchException
    assert "LOCKED" in str(exc)
    assert "UNLOCK" in str(exc)
    assert type(kv_exception(KvStatus.LOCKED, KvOpcode.GET_AND_LOCK)) is DocumentLockedException


def test_exclusions_hold_even_when_the_error_map_says_retry() -> None:
    emap = error_map({0x09: ["item-locked", "retry-later"], 0x88: ["retry-now"]})
    assert kv_retry_reason(0x09, KvOpcode.UNLOCK, emap) is None
    assert kv_retry_reason(0x88, KvOpcode.GET_COLLECTION_ID, emap) is None


def test_success_is_never_a_retry_reason() -> None:
    emap = error_map({0x00: ["success", "retry-now"]})
    for op in KvOpcode:
        assert kv_retry_reason(0, op, emap) is None
    with pytest.raises(ValueError, match="SUCCESS is not a failure"):
        kv_exception(0, KvOpcode.GET)


# -- error map --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        (["retry-now"], R.KV_ERROR_MAP_RETRY_INDICATED),
        (["retry-later"], R.KV_ERROR_MAP_RETRY_INDICATED),
        (["temp", "retry-later", "item-only"], R.KV_ERROR_MAP_RETRY_INDICATED),
        (["temp"], None),
        (["auto-retry"], None),
        ([], None),
    ],
)
def test_unknown_status_retry_follows_error_map_attributes(
    attrs: list[str], expected: RetryReason | None
) -> None:
    emap = error_map({0x7FF0: attrs})
    assert kv_retry_reason(0x7FF0, KvOpcode.SET, emap) is expected
    assert kv_retry_reason(0x7FF0, KvOpcode.SET) is None  # no map, no retry
    assert kv_retry_reason(0x7FF1, KvOpcode.SET, emap) is None  # not in the map


def test_error_map_is_consulted_for_any_status_outside_the_rows_but_not_dcp() -> None:
    emap = error_map({0x01: ["item-only", "retry-now"], 0x7FF0: ["retry-now"]})
    # The issue: "any other status" goes to the error map, known to KvStatus or not.
    assert kv_retry_reason(KvStatus.KEY_NOT_FOUND, KvOpcode.GET, emap) is (
        R.KV_ERROR_MAP_RETRY_INDICATED
    )
    assert kv_retry_reason(KvStatus.KEY_NOT_FOUND, KvOpcode.GET) is None
    assert kv_retry_reason(0x7FF0, KvOpcode.DCP_STREAM_REQUEST, emap) is None
    assert kv_retry_reason(KvStatus.KEY_NOT_FOUND, KvOpcode.DCP_MUTATION, emap) is None


#: Answers that do not prove the command changed nothing (rfc/0002).
OUTCOME_UNKNOWN = (KvStatus.SYNC_WRITE_AMBIGUOUS, KvStatus.INTERNAL_ERROR)


@pytest.mark.anyio
@pytest.mark.parametrize("status", OUTCOME_UNKNOWN)
async def test_an_error_map_never_retries_an_answer_that_may_have_been_applied(
    status: KvStatus,
) -> None:
    """An error map marking SYNC_WRITE_AMBIGUOUS or INTERNAL_ERROR retry-later must not
    resend a non-idempotent write booked "not applied" (KV_ERROR_MAP_RETRY_INDICATED
    retries any request): the durable write may have committed. The request ends with
    the status's own exception, its attempt maybe applied."""
    emap = error_map({status: ["retry-later", "internal"]})
    assert kv_retry_reason(status, KvOpcode.SET, emap) is None
    clock = VirtualClock()
    request = kv_request(KvOpcode.SET, timeout=0.5, clock=clock.clock)  # not idempotent
    sent = 0

    async def send(r: Request) -> None:
        nonlocal sent
        sent += 1
        raise_failure(kv_failure(status, KvOpcode.SET, emap))

    expected = (
        DurabilityAmbiguousException
        if status is KvStatus.SYNC_WRITE_AMBIGUOUS
        else InternalServerFailureException
    )
    with pytest.raises(expected) as caught:
        await RetryOrchestrator(sleep=clock.sleep).execute(request, send)
    assert sent == 1
    assert clock.sleeps == []
    context = caught.value.context
    assert context is not None
    assert [a.effect for a in context.attempts] == [AttemptEffect.MAYBE_APPLIED]


def test_unknown_status_exception_names_the_error_map_entry() -> None:
    emap = error_map({0x7FF0: ["internal"]})
    exc = kv_failure(0x7FF0, KvOpcode.SET, emap)
    assert type(exc) is CouchbaseException
    assert "0x7ff0" in str(exc)
    assert "E7ff0" in str(exc)
    assert "status 7ff0" in str(exc)
    assert "unknown status" in str(kv_exception(0x7FF0, 0x42))


# -- exceptions --------------------------------------------------------------------

EXCEPTION_ROWS: list[tuple[int, int, type[CouchbaseException]]] = [
    (KvStatus.KEY_NOT_FOUND, KvOpcode.GET, DocumentNotFoundException),
    (KvStatus.KEY_EXISTS, KvOpcode.ADD, DocumentExistsException),
    (KvStatus.KEY_EXISTS, KvOpcode.REPLACE, CasMismatchException),
    (KvStatus.KEY_EXISTS, KvOpcode.APPEND, CasMismatchException),
    (KvStatus.VALUE_TOO_LARGE, KvOpcode.SET, ValueTooLargeException),
    (KvStatus.INVALID_ARGUMENTS, KvOpcode.SET, InvalidArgumentException),
    (KvStatus.NOT_STORED, KvOpcode.ADD, DocumentExistsException),
    (KvStatus.NOT_STORED, KvOpcode.APPEND, CouchbaseException),
    (KvStatus.NO_BUCKET, KvOpcode.GET, BucketNotFoundException),
    (KvStatus.LOCKED, KvOpcode.UNLOCK, CasMismatchException),
    (KvStatus.LOCKED, KvOpcode.SET, DocumentLockedException),
    (KvStatus.NOT_LOCKED, KvOpcode.UNLOCK, DocumentNotLockedException),
    (KvStatus.AUTH_ERROR, KvOpcode.GET, AuthenticationFailureException),
    (KvStatus.NO_ACCESS, KvOpcode.GET, AuthenticationFailureException),
    (KvStatus.RATE_LIMITED_MAX_COMMANDS, KvOpcode.GET, RateLimitedException),
    (KvStatus.SCOPE_SIZE_LIMIT_EXCEEDED, KvOpcode.SET, QuotaLimitedException),
    (KvStatus.NOT_SUPPORTED, KvOpcode.GET, FeatureNotAvailableException),
    (KvStatus.INTERNAL_ERROR, KvOpcode.GET, InternalServerFailureException),
    (KvStatus.BUSY, KvOpcode.GET, TemporaryFailureException),
    (KvStatus.TEMPORARY_FAILURE, KvOpcode.GET, TemporaryFailureException),
    (KvStatus.UNKNOWN_COLLECTION, KvOpcode.GET_COLLECTION_ID, CollectionNotFoundException),
    (KvStatus.UNKNOWN_SCOPE, KvOpcode.GET_COLLECTION_ID, ScopeNotFoundException),
    (KvStatus.SYNC_WRITE_AMBIGUOUS, KvOpcode.SET, DurabilityAmbiguousException),
]


@pytest.mark.parametrize(("status", "opcode", "cls"), EXCEPTION_ROWS)
def test_kv_exception_rows(status: int, opcode: int, cls: type[CouchbaseException]) -> None:
    exc = kv_exception(status, opcode)
    assert type(exc) is cls
    assert f"0x{int(status):02x}" in str(exc)


def test_key_exists_with_cas_is_cas_mismatch() -> None:
    assert type(kv_exception(KvStatus.KEY_EXISTS, KvOpcode.DELETE)) is DocumentExistsException
    exc = kv_exception(KvStatus.KEY_EXISTS, KvOpcode.DELETE, with_cas=True)
    assert type(exc) is CasMismatchException


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("7", 0), TypeError, r"kv_retry_reason\(status\) must be an int"),
        ((True, 0), TypeError, r"kv_retry_reason\(status\) must be an int"),
        ((0x10000, 0), ValueError, r"kv_retry_reason\(status\) must be in 0..0xffff"),
        ((7, -1), ValueError, r"kv_retry_reason\(opcode\) must be in 0..0xff"),
        ((7, 0x100), ValueError, r"kv_retry_reason\(opcode\) must be in 0..0xff"),
    ],
)
def test_bad_input_is_rejected_clearly(
    args: tuple[object, object], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        kv_retry_reason(*args)  # type: ignore[arg-type]


def test_int_enum_members_are_accepted() -> None:
    assert kv_retry_reason(KvStatus.BUSY, KvOpcode.SET) is R.KV_TEMPORARY_FAILURE


# -- properties --------------------------------------------------------------------

statuses = st.integers(0, 0xFFFF)
opcodes = st.integers(0, 0xFF)
attrs = st.lists(
    st.sampled_from(["retry-now", "retry-later", "temp", "item-only", "auto-retry", "internal"]),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(statuses, opcodes)
def test_no_status_outside_the_table_is_retried_without_an_error_map(
    status: int, opcode: int
) -> None:
    reason = kv_retry_reason(status, opcode)
    if status not in KV_RETRY_STATUSES or opcode in DCP_OPCODES or (status, opcode) in EXCLUDED:
        assert reason is None
    else:
        assert reason is KV_RETRY_STATUSES[status]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(statuses, attrs, min_size=1, max_size=6), opcodes, st.data())
def test_error_map_only_adds_error_map_retry_outside_the_fixed_rows(
    entries: dict[int, list[str]], opcode: int, data: st.DataObject
) -> None:
    emap = error_map(entries)
    # Mostly a status the map has an entry for, so the error-map branch is exercised.
    status = data.draw(st.sampled_from(sorted(entries)) | statuses, label="status")
    with_map = kv_retry_reason(status, opcode, emap)
    without = kv_retry_reason(status, opcode)
    if with_map is not without:
        assert without is None
        assert with_map is R.KV_ERROR_MAP_RETRY_INDICATED
        assert status not in KV_RETRY_STATUSES
        assert status != 0
        assert opcode not in DCP_OPCODES
        assert status not in OUTCOME_UNKNOWN
        assert {"retry-now", "retry-later"} & set(entries[status])
    indicated = status in entries and bool({"retry-now", "retry-later"} & set(entries[status]))
    if (
        indicated
        and status not in KV_RETRY_STATUSES
        and status not in OUTCOME_UNKNOWN
        and status != 0
        and opcode not in DCP_OPCODES
    ):
        assert with_map is R.KV_ERROR_MAP_RETRY_INDICATED


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 0xFFFF), opcodes, st.booleans())
def test_kv_failure_is_a_reason_or_a_couchbase_exception(
    status: int, opcode: int, cas: bool
) -> None:
    result = kv_failure(status, opcode, with_cas=cas)
    assert isinstance(result, (RetryReason, CouchbaseException))
    assert isinstance(result, RetryReason) == (kv_retry_reason(status, opcode) is not None)
