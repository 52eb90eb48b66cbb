"""HTTP service failures (query, analytics, search, views) -> RetryReason.

RFC 0049 "Response Code Retry List". The query and analytics helpers take the
service's decoded ``errors`` array; search and views take the HTTP status and
the raw body. None means "do not retry; complete the request with its error".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._context import ErrorContext
from .._errors import (
    AuthenticationFailureException,
    CouchbaseException,
    QuotaLimitedException,
    RateLimitedException,
)
from .._reason import RetryReason
from .._untrusted import show as _show

__all__ = [
    "SEARCH_QUOTA_LIMIT_MARKERS",
    "SEARCH_RATE_LIMIT_MARKERS",
    "analytics_retry_reason",
    "query_retry_reason",
    "search_exception",
    "search_retry_reason",
    "views_retry_reason",
]

# -- query / analytics -------------------------------------------------------------

_QUERY_PREPARED = frozenset({4040, 4050, 4070})
_QUERY_INDEX_NOT_FOUND_CODE = 5000
_QUERY_INDEX_NOT_FOUND_TEXT = "queryport.indexNotFound"
_QUERY_TXN_BUFFER_FULL = 17013
#: "retry": true on this code is ignored (MB-50643: index not found must stay an error).
_QUERY_RETRY_FLAG_IGNORED = 12016
_ANALYTICS_TEMPORARY = frozenset({23000, 23003, 23007})


def _first_error(errors: Sequence[Mapping[str, Any]], what: str) -> tuple[int, str, Any] | None:
    """``(code, msg, retry)`` of the first error, or None when there is nothing to decide on.

    Only the shape of ``errors`` is enforced (a sequence of mappings: TypeError
    otherwise). A first error without an integer ``code`` is "anything else": None.
    A ``msg`` that is not a string is read as empty.
    """
    if isinstance(errors, (str, bytes, bytearray, Mapping)) or not isinstance(errors, Sequence):
        raise TypeError(
            f'{what}(errors) takes the service\'s decoded "errors" array (a sequence of '
            f"mappings), got {type(errors).__name__}"
        )
    for index, error in enumerate(errors):
        if not isinstance(error, Mapping):
            raise TypeError(
                f"{what}(errors): errors[{index}] must be a mapping (a decoded JSON object), "
                f"got {type(error).__name__}"
            )
    if not errors:
        return None
    first = errors[0]
    code = first.get("code")
    if isinstance(code, bool) or not isinstance(code, int):
        return None  # float, str, None, ...: no table row can match
    code = int(code)
    msg = first.get("msg")
    return code, msg if isinstance(msg, str) else "", first.get("retry")


def query_retry_reason(errors: Sequence[Mapping[str, Any]]) -> RetryReason | None:
    """The RetryReason for a failed query, from its ``errors`` array.

    Like the Java and Go SDKs, the first error decides (one without an integer
    ``code`` is no retry reason; ``errors`` that is not a sequence of mappings
    raises TypeError):

    * 4040, 4050, 4070 -> QUERY_PREPARED_STATEMENT_FAILURE (the caller must drop
      the prepared statement from its cache before the retry re-prepares it);
    * 5000 whose ``msg`` contains ``queryport.indexNotFound`` -> QUERY_INDEX_NOT_FOUND;
    * 17013 -> QUERY_TRANSACTION_BUFFER_FULL;
    * ``"retry": true`` -> QUERY_ERROR_RETRYABLE, except on code 12016;
    * anything else -> None.
    """
    first = _first_error(errors, "query_retry_reason")
    if first is None:
        return None
    code, msg, retry = first
    if code in _QUERY_PREPARED:
        return RetryReason.QUERY_PREPARED_STATEMENT_FAILURE
    if code == _QUERY_INDEX_NOT_FOUND_CODE and _QUERY_INDEX_NOT_FOUND_TEXT in msg:
        return RetryReason.QUERY_INDEX_NOT_FOUND
    if code == _QUERY_TXN_BUFFER_FULL:
        return RetryReason.QUERY_TRANSACTION_BUFFER_FULL
    if retry is True and code != _QUERY_RETRY_FLAG_IGNORED:
        return RetryReason.QUERY_ERROR_RETRYABLE
    return None


def analytics_retry_reason(errors: Sequence[Mapping[str, Any]]) -> RetryReason | None:
    """ANALYTICS_TEMPORARY_FAILURE when the first error's code is 23000, 23003 or 23007.

    Anything else is None, a first error without an integer ``code`` included;
    ``errors`` that is not a sequence of mappings raises TypeError.
    """
    first = _first_error(errors, "analytics_retry_reason")
    if first is not None and first[0] in _ANALYTICS_TEMPORARY:
        return RetryReason.ANALYTICS_TEMPORARY_FAILURE
    return None


# -- search ------------------------------------------------------------------------

#: Body markers of a 429 that is a rate limit (not retried; RateLimitedException).
SEARCH_RATE_LIMIT_MARKERS = (
    "num_concurrent_requests",
    "num_queries_per_min",
    "ingress_mib_per_min",
    "egress_mib_per_min",
)
#: Body markers of a quota limit (not retried; QuotaLimitedException).
SEARCH_QUOTA_LIMIT_MARKERS = ("num_fts_indexes",)


def _text(body: str | bytes | bytearray | memoryview, what: str) -> str:
    if isinstance(body, str):
        return body
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body).decode("utf-8", errors="replace")
    raise TypeError(f"{what}(body) must be str or bytes, got {type(body).__name__}")


def _status(http_status: int, what: str) -> int:
    if isinstance(http_status, bool) or not isinstance(http_status, int):
        raise TypeError(f"{what}(http_status) must be an int, got {_show(http_status)}")
    if not 100 <= http_status <= 599:
        raise ValueError(
            f"{what}(http_status) must be an HTTP status 100..599, got {_show(http_status)}"
        )
    return http_status


def _search_limit(text: str) -> type[CouchbaseException] | None:
    if any(marker in text for marker in SEARCH_QUOTA_LIMIT_MARKERS):
        return QuotaLimitedException
    if any(marker in text for marker in SEARCH_RATE_LIMIT_MARKERS):
        return RateLimitedException
    return None


def search_retry_reason(http_status: int, body: str | bytes = "") -> RetryReason | None:
    """SEARCH_TOO_MANY_REQUESTS for HTTP 429, unless the body shows a rate or quota limit.

    A limit (see :data:`SEARCH_RATE_LIMIT_MARKERS`, :data:`SEARCH_QUOTA_LIMIT_MARKERS`)
    is not retried; :func:`search_exception` turns it into RateLimitedException or
    QuotaLimitedException.
    """
    if _status(http_status, "search_retry_reason") != 429:
        return None
    if _search_limit(_text(body, "search_retry_reason")) is not None:
        return None
    return RetryReason.SEARCH_TOO_MANY_REQUESTS


def search_exception(
    http_status: int, body: str | bytes = "", *, context: ErrorContext | None = None
) -> CouchbaseException:
    """The exception a failed search request completes with.

    429 or 400 with a limit marker -> RateLimitedException / QuotaLimitedException;
    401, 403 -> AuthenticationFailureException; otherwise CouchbaseException
    naming the HTTP status and the start of the body.
    """
    status = _status(http_status, "search_exception")
    text = _text(body, "search_exception")
    snippet = f"HTTP {status}: {text[:200]}" if text else f"HTTP {status}, empty body"
    if status in (400, 429):
        limit = _search_limit(text)
        if limit is not None:
            return limit(f"{limit.default_message} (search {snippet})", context=context)
    if status in (401, 403):
        return AuthenticationFailureException(
            f"search authentication failed ({snippet})", context=context
        )
    return CouchbaseException(f"search request failed ({snippet})", context=context)


# -- views -------------------------------------------------------------------------

_VIEWS_TEMPORARY = frozenset({300, 301, 303, 307, 401, 408, 409, 412, 416, 417, 501, 502, 503, 504})
#: The literal text the issue names; a body spelled with spaces around ``:`` does not match.
_VIEWS_MISSING = '"reason":"missing"'


def views_retry_reason(http_status: int, body: str | bytes = "") -> RetryReason | None:
    """The RetryReason for a failed view request.

    * 302 -> VIEWS_NO_ACTIVE_PARTITION;
    * 300, 301, 303, 307, 401, 408, 409, 412, 416, 417, 501, 502, 503, 504
      -> VIEWS_TEMPORARY_FAILURE;
    * 404 only if the body contains the literal text ``"reason":"missing"`` (an
      unprovisioned node; no whitespace allowed around the ``:``)
      -> VIEWS_TEMPORARY_FAILURE;
    * 500 unless the body contains ``error`` together with
      ``{not_found, missing_named_view}`` or ``"badarg"`` (with its quotes, as the RFC
      writes it and the ``"reason":"missing"`` row above reads it: a malformed query)
      -> VIEWS_TEMPORARY_FAILURE;
    * anything else (200 included) -> None.
    """
    status = _status(http_status, "views_retry_reason")
    if status == 302:
        return RetryReason.VIEWS_NO_ACTIVE_PARTITION
    if status in _VIEWS_TEMPORARY:
        return RetryReason.VIEWS_TEMPORARY_FAILURE
    if status == 404:
        if _VIEWS_MISSING in _text(body, "views_retry_reason"):
            return RetryReason.VIEWS_TEMPORARY_FAILURE
        return None
    if status == 500:
        text = _text(body, "views_retry_reason")
        if "error" in text and ("{not_found, missing_named_view}" in text or '"badarg"' in text):
            return None
        return RetryReason.VIEWS_TEMPORARY_FAILURE
    return None
