"""RetryReason: every row of the RFC 0049 table, with its two flags."""

from __future__ import annotations

import pytest

from sdkcore import RetryReason

# The RFC 0049 "RetryReason" table, written out literally:
# (name, allows non-idempotent retry, always retry).
# The RFC leaves the five terminal reasons as "todo"; the issue fixes them (and the two
# query reasons the RFC does not list) as "non-idempotent retry: yes, always retry: no".
RFC_TABLE: list[tuple[str, bool, bool]] = [
    ("UNKNOWN", False, False),
    ("SOCKET_NOT_AVAILABLE", True, False),
    ("SERVICE_NOT_AVAILABLE", True, False),
    ("NODE_NOT_AVAILABLE", True, False),
    ("KV_NOT_MY_VBUCKET", True, True),
    ("KV_COLLECTION_OUTDATED", True, True),
    ("KV_ERROR_MAP_RETRY_INDICATED", True, False),
    ("KV_LOCKED", True, False),
    ("KV_TEMPORARY_FAILURE", True, False),
    ("KV_SYNC_WRITE_IN_PROGRESS", True, False),
    ("KV_SYNC_WRITE_RE_COMMIT_IN_PROGRESS", True, False),
    ("SERVICE_RESPONSE_CODE_INDICATED", True, False),
    ("SOCKET_CLOSED_WHILE_IN_FLIGHT", False, False),
    ("CIRCUIT_BREAKER_OPEN", True, False),
    ("QUERY_PREPARED_STATEMENT_FAILURE", True, False),
    ("QUERY_INDEX_NOT_FOUND", True, False),
    ("ANALYTICS_TEMPORARY_FAILURE", True, False),
    ("SEARCH_TOO_MANY_REQUESTS", True, False),
    ("VIEWS_TEMPORARY_FAILURE", True, False),
    ("VIEWS_NO_ACTIVE_PARTITION", True, True),
    # "Fail Fast (Terminal Errors)"
    ("AUTHENTICATION_ERROR", True, False),
    ("TLS_ERROR", True, False),
    ("BUCKET_ACCESS_ERROR", True, False),
    ("SCOPE_NOT_FOUND", True, False),
    ("COLLECTION_NOT_FOUND", True, False),
    # Query reasons added by the issue
    ("QUERY_ERROR_RETRYABLE", True, False),
    ("QUERY_TRANSACTION_BUFFER_FULL", True, False),
    # sdkcore's load shedding (rfc/0009): refused before sending
    ("CONCURRENCY_LIMITED", True, False),
    ("CLIENT_THROTTLED", True, False),
]

TERMINAL = [
    "AUTHENTICATION_ERROR",
    "TLS_ERROR",
    "BUCKET_ACCESS_ERROR",
    "SCOPE_NOT_FOUND",
    "COLLECTION_NOT_FOUND",
]


def test_table_has_no_duplicate_rows() -> None:
    names = [name for name, _, _ in RFC_TABLE]
    assert len(names) == len(set(names)) == 29


def test_no_reason_missing_or_extra() -> None:
    assert {m.name for m in RetryReason} == {name for name, _, _ in RFC_TABLE}
    assert len(list(RetryReason)) == len(RFC_TABLE)


@pytest.mark.parametrize(
    ("name", "non_idempotent", "always"), RFC_TABLE, ids=[r[0] for r in RFC_TABLE]
)
def test_flags_match_rfc_row(name: str, non_idempotent: bool, always: bool) -> None:
    reason = RetryReason[name]
    assert reason.allows_non_idempotent_retry is non_idempotent
    assert reason.always_retry is always


@pytest.mark.parametrize("name", TERMINAL)
def test_terminal_reasons_allow_non_idempotent_retry_but_are_not_always_retried(name: str) -> None:
    reason = RetryReason[name]
    assert reason.allows_non_idempotent_retry is True
    assert reason.always_retry is False


def test_exactly_three_always_retry_reasons() -> None:
    assert {r.name for r in RetryReason if r.always_retry} == {
        "KV_NOT_MY_VBUCKET",
        "KV_COLLECTION_OUTDATED",
        "VIEWS_NO_ACTIVE_PARTITION",
    }


def test_exactly_two_reasons_forbid_non_idempotent_retry() -> None:
    assert {r.name for r in RetryReason if not r.allows_non_idempotent_retry} == {
        "UNKNOWN",
        "SOCKET_CLOSED_WHILE_IN_FLIGHT",
    }


def test_flags_are_plain_bools() -> None:
    for reason in RetryReason:
        assert type(reason.allows_non_idempotent_retry) is bool
        assert type(reason.always_retry) is bool


def test_members_are_hashable_and_distinct() -> None:
    assert len({r: None for r in RetryReason}) == len(RFC_TABLE)
    assert RetryReason.KV_LOCKED is RetryReason["KV_LOCKED"]
    assert repr(RetryReason.KV_LOCKED) == "<RetryReason.KV_LOCKED>"
