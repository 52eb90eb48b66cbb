"""Query, analytics, search and views failures -> RetryReason (RFC 0049 response code list)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdkcore import (
    AuthenticationFailureException,
    CouchbaseException,
    QuotaLimitedException,
    RateLimitedException,
    RetryReason,
)
from sdkcore.mapping import (
    analytics_retry_reason,
    query_retry_reason,
    search_exception,
    search_retry_reason,
    views_retry_reason,
)

R = RetryReason


# -- query -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ({"code": 4040, "msg": "No such prepared statement"}, R.QUERY_PREPARED_STATEMENT_FAILURE),
        ({"code": 4050, "msg": "Unrecognizable prepared"}, R.QUERY_PREPARED_STATEMENT_FAILURE),
        ({"code": 4070, "msg": "Unable to decode prepared"}, R.QUERY_PREPARED_STATEMENT_FAILURE),
        (
            {"code": 5000, "msg": "... queryport.indexNotFound ..."},
            R.QUERY_INDEX_NOT_FOUND,
        ),
        ({"code": 5000, "msg": "some other internal error"}, None),
        ({"code": 17013, "msg": "Transaction buffer full"}, R.QUERY_TRANSACTION_BUFFER_FULL),
        ({"code": 1234, "msg": "x", "retry": True}, R.QUERY_ERROR_RETRYABLE),
        ({"code": 12016, "msg": "Index not found", "retry": True}, None),
        ({"code": 1234, "msg": "x", "retry": False}, None),
        ({"code": 1234, "msg": "x"}, None),
        ({"code": 4060, "msg": "x"}, None),
        ({"code": 12004, "msg": "primary index not found"}, None),
        # Code rules come before the retry flag.
        ({"code": 4040, "msg": "x", "retry": True}, R.QUERY_PREPARED_STATEMENT_FAILURE),
        ({"code": 17013, "msg": "x", "retry": True}, R.QUERY_TRANSACTION_BUFFER_FULL),
    ],
)
def test_query_rows(error: dict[str, Any], expected: RetryReason | None) -> None:
    assert query_retry_reason([error]) is expected


def test_query_first_error_decides() -> None:
    assert query_retry_reason([]) is None
    retryable = {"code": 4040, "msg": "x"}
    other = {"code": 3000, "msg": "syntax error"}
    assert query_retry_reason([retryable, other]) is R.QUERY_PREPARED_STATEMENT_FAILURE
    assert query_retry_reason([other, retryable]) is None


@pytest.mark.parametrize(
    ("errors", "error", "match"),
    [
        ({"code": 4040}, TypeError, 'decoded "errors" array'),
        ("4040", TypeError, 'decoded "errors" array'),
        ([4040], TypeError, r"errors\[0\] must be a mapping"),
        ([{"msg": "x"}], ValueError, r'errors\[0\]\["code"\] must be an integer'),
        ([{"code": "4040"}], ValueError, r'errors\[0\]\["code"\] must be an integer'),
        ([{"code": 5000, "msg": 3}], ValueError, r'errors\[0\]\["msg"\] must be a string'),
    ],
)
def test_query_bad_input(errors: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        query_retry_reason(errors)


# -- analytics ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (23000, R.ANALYTICS_TEMPORARY_FAILURE),
        (23003, R.ANALYTICS_TEMPORARY_FAILURE),
        (23007, R.ANALYTICS_TEMPORARY_FAILURE),
        (23001, None),
        (24045, None),
        (4040, None),
    ],
)
def test_analytics_rows(code: int, expected: RetryReason | None) -> None:
    assert analytics_retry_reason([{"code": code, "msg": "m"}]) is expected


# -- search ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "expected", "exc"),
    [
        (429, "", R.SEARCH_TOO_MANY_REQUESTS, CouchbaseException),
        (429, '{"error": "rest_index: too many requests"}', R.SEARCH_TOO_MANY_REQUESTS, None),
        (429, "query request rejected: num_concurrent_requests limit", None, RateLimitedException),
        (429, b"num_queries_per_min exceeded", None, RateLimitedException),
        (429, "ingress_mib_per_min", None, RateLimitedException),
        (429, "egress_mib_per_min", None, RateLimitedException),
        (429, "num_fts_indexes limit reached", None, QuotaLimitedException),
        (400, "num_fts_indexes limit reached", None, QuotaLimitedException),
        (400, "bad query", None, CouchbaseException),
        (401, "", None, AuthenticationFailureException),
        (403, "", None, AuthenticationFailureException),
        (500, "boom", None, CouchbaseException),
        (200, "", None, None),
    ],
)
def test_search_rows(
    status: int,
    body: str | bytes,
    expected: RetryReason | None,
    exc: type[CouchbaseException] | None,
) -> None:
    assert search_retry_reason(status, body) is expected
    if exc is not None:
        assert type(search_exception(status, body)) is exc


def test_search_exception_mentions_status_and_body() -> None:
    exc = search_exception(429, "num_concurrent_requests")
    assert "429" in str(exc)
    assert "num_concurrent_requests" in str(exc)


# -- views -------------------------------------------------------------------------

VIEWS_TEMPORARY = [300, 301, 303, 307, 401, 408, 409, 412, 416, 417, 501, 502, 503, 504]


@pytest.mark.parametrize("status", VIEWS_TEMPORARY)
def test_views_temporary_codes(status: int) -> None:
    assert views_retry_reason(status) is R.VIEWS_TEMPORARY_FAILURE
    assert views_retry_reason(status, '{"error":"x"}') is R.VIEWS_TEMPORARY_FAILURE


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (302, "", R.VIEWS_NO_ACTIVE_PARTITION),
        (404, '{"error":"not_found","reason":"missing"}', R.VIEWS_TEMPORARY_FAILURE),
        (404, b'{"error": "not_found", "reason": "missing"}', R.VIEWS_TEMPORARY_FAILURE),
        (404, '{"error":"not_found","reason":"deleted"}', None),
        (404, "", None),
        (500, "", R.VIEWS_TEMPORARY_FAILURE),
        (500, '{"error":"unknown","reason":"crash"}', R.VIEWS_TEMPORARY_FAILURE),
        (500, '{"error":"{not_found, missing_named_view}"}', None),
        (500, '{"error":"query_parse_error","reason":"badarg"}', None),
        (500, '{"reason":"badarg"}', R.VIEWS_TEMPORARY_FAILURE),  # "error" is required too
        (200, "", None),
        (400, "", None),
        (505, "", None),
    ],
)
def test_views_rows(status: int, body: str | bytes, expected: RetryReason | None) -> None:
    assert views_retry_reason(status, body) is expected


@pytest.mark.parametrize("fn", [views_retry_reason, search_retry_reason, search_exception])
def test_http_status_validation(fn: Any) -> None:
    with pytest.raises(ValueError, match=r"100\.\.599"):
        fn(99)
    with pytest.raises(TypeError, match="must be an int"):
        fn("429")
    with pytest.raises(TypeError, match="must be str or bytes"):
        fn(429 if fn is not views_retry_reason else 404, 3)


# -- properties --------------------------------------------------------------------

QUERY_CODES = {4040, 4050, 4070, 5000, 17013}


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 100_000),
    st.text(max_size=40) | st.just("x queryport.indexNotFound y"),
    st.none() | st.booleans(),
)
def test_query_property(code: int, msg: str, retry: bool | None) -> None:
    error: dict[str, Any] = {"code": code, "msg": msg}
    if retry is not None:
        error["retry"] = retry
    reason = query_retry_reason([error])
    if code not in QUERY_CODES and not (retry and code != 12016):
        assert reason is None
    assert reason is None or isinstance(reason, RetryReason)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 100_000))
def test_analytics_property(code: int) -> None:
    reason = analytics_retry_reason([{"code": code, "msg": ""}])
    assert (reason is not None) == (code in {23000, 23003, 23007})


@settings(max_examples=300, deadline=None)
@given(st.integers(100, 599), st.text(max_size=60))
def test_search_and_views_property(status: int, body: str) -> None:
    search = search_retry_reason(status, body)
    if status != 429:
        assert search is None
    assert isinstance(search_exception(status, body), CouchbaseException)
    views = views_retry_reason(status, body)
    if status not in {*VIEWS_TEMPORARY, 302, 404, 500}:
        assert views is None
