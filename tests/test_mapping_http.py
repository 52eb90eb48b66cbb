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


@pytest.mark.parametrize("fn", [query_retry_reason, analytics_retry_reason])
@pytest.mark.parametrize(
    ("errors", "match"),
    [
        ({"code": 4040}, 'decoded "errors" array'),
        ("4040", 'decoded "errors" array'),
        (b"[]", 'decoded "errors" array'),
        (None, 'decoded "errors" array'),
        ([4040], r"errors\[0\] must be a mapping"),
        ([{"code": 4040}, "x"], r"errors\[1\] must be a mapping"),
    ],
)
def test_errors_that_are_not_a_sequence_of_mappings_raise(fn: Any, errors: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        fn(errors)


# An error object without an integer code is not a retry reason ("anything else -> None"):
# the mapper runs on the failure path and must not turn a server's odd error into a crash.
ODD_ERRORS: list[dict[str, Any]] = [
    {"msg": "no code at all"},
    {"code": "4040", "msg": "code as a string"},
    {"code": None, "msg": "x", "retry": True},
    {"code": True, "msg": "boolean code"},
    {"code": 4040.0, "msg": "float code"},
    {"code": "23000"},
    {},
]


@pytest.mark.parametrize("error", ODD_ERRORS)
def test_error_objects_without_an_integer_code_are_no_retry_reason(error: dict[str, Any]) -> None:
    assert query_retry_reason([error]) is None
    assert analytics_retry_reason([error]) is None
    # The first error still decides, even when it is the odd one.
    assert query_retry_reason([error, {"code": 4040, "msg": "x"}]) is None
    assert analytics_retry_reason([error, {"code": 23000, "msg": "x"}]) is None


def test_non_string_msg_never_matches_the_index_not_found_text() -> None:
    assert query_retry_reason([{"code": 5000, "msg": 3}]) is None
    assert query_retry_reason([{"code": 5000, "msg": None}]) is None
    assert query_retry_reason([{"code": 5000, "msg": ["queryport.indexNotFound"]}]) is None
    assert query_retry_reason([{"code": 4040, "msg": 3}]) is R.QUERY_PREPARED_STATEMENT_FAILURE


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


def test_search_exception_says_when_the_body_is_empty() -> None:
    # "(HTTP 500: )" read as a cut message (an operator's review)
    assert "(HTTP 500, empty body)" in str(search_exception(500, ""))


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
        (404, b'{"error":"not_found","reason":"missing"}', R.VIEWS_TEMPORARY_FAILURE),
        # The issue asks for the literal text: a spaced-out body does not match.
        (404, b'{"error": "not_found", "reason": "missing"}', None),
        (404, '{"reason" : "missing"}', None),
        (404, '{"error":"not_found","reason":"deleted"}', None),
        (404, "", None),
        (500, "", R.VIEWS_TEMPORARY_FAILURE),
        (500, '{"error":"unknown","reason":"crash"}', R.VIEWS_TEMPORARY_FAILURE),
        (500, '{"error":"{not_found, missing_named_view}"}', None),
        (500, '{"error":"query_parse_error","reason":"badarg"}', None),
        (500, '{"reason":"badarg"}', R.VIEWS_TEMPORARY_FAILURE),  # "error" is required too
        # the token is "badarg" with its quotes (RFC 0049: ""badarg""), not the bare word
        (500, '{"error":"view_server_error","reason":"badargument"}', R.VIEWS_TEMPORARY_FAILURE),
        (500, '{"error":"x","reason":"no badarg here"}', R.VIEWS_TEMPORARY_FAILURE),
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

# The query table, written out here rather than read from the module.
QUERY_TABLE = {
    4040: R.QUERY_PREPARED_STATEMENT_FAILURE,
    4050: R.QUERY_PREPARED_STATEMENT_FAILURE,
    4070: R.QUERY_PREPARED_STATEMENT_FAILURE,
    17013: R.QUERY_TRANSACTION_BUFFER_FULL,
}
INDEX_NOT_FOUND_TEXT = "queryport.indexNotFound"


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([4040, 4050, 4070, 5000, 12016, 17013]) | st.integers(0, 100_000),
    st.text(max_size=40) | st.just(f"x {INDEX_NOT_FOUND_TEXT} y"),
    st.none() | st.booleans(),
)
def test_query_property(code: int, msg: str, retry: bool | None) -> None:
    error: dict[str, Any] = {"code": code, "msg": msg}
    if retry is not None:
        error["retry"] = retry
    reason = query_retry_reason([error])
    if code in QUERY_TABLE:
        expected = QUERY_TABLE[code]  # code rows come before the retry flag
    elif code == 5000 and INDEX_NOT_FOUND_TEXT in msg:
        expected = R.QUERY_INDEX_NOT_FOUND
    elif retry is True and code != 12016:
        expected = R.QUERY_ERROR_RETRYABLE
    else:
        expected = None
    assert reason is expected


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
