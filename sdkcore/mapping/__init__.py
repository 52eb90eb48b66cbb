"""Failure mappers: what an SDK's I/O code calls when something fails.

Each helper decides whether a failure goes to the orchestrator (it returns a
:class:`~sdkcore.RetryReason`; :func:`grpc_failure` a :class:`~sdkcore.RetryableError`
that also carries the attempt's effect) or completes the request with an error (it
returns None, or the exception to raise). No server answer is recorded as NOT_SENT
(rfc/0002 "Attempt effect"). All decision functions are pure: no I/O, no
clock, tables precomputed at import. See rfc/0002-failure-mapping.md.

* KV: :func:`kv_retry_reason`, :func:`kv_exception`, :func:`kv_failure`,
  :class:`KvStatus`, :class:`KvOpcode`, :class:`ErrorMap`.
* HTTP services: :func:`query_retry_reason`, :func:`analytics_retry_reason`,
  :func:`search_retry_reason` / :func:`search_exception`, :func:`views_retry_reason`.
* Couchbase gRPC: :func:`grpc_failure`.
* Connection stage: :func:`dispatch_failure_reason`, :func:`retry_allowed`.
* Idempotency: :func:`is_idempotent_kv`, :func:`is_idempotent_http`,
  :func:`kv_request`, :func:`http_request`.

In a ``send`` for ``RetryOrchestrator.execute``::

    raise_failure(kv_failure(status, opcode, error_map))
"""

from ._error_map import (
    RETRY_ATTRIBUTES,
    ErrorCode,
    ErrorMap,
    ErrorMapError,
    RetrySpec,
    RetrySpecStrategy,
)
from ._exceptions import (
    BucketExistsException,
    BucketNotFoundException,
    CollectionExistsException,
    DocumentNotJsonException,
    DocumentNotLockedException,
    DocumentTooDeepException,
    DurabilityAmbiguousException,
    DurabilityImpossibleException,
    DurabilityLevelNotAvailableException,
    DurableWriteInProgressException,
    DurableWriteReCommitInProgressException,
    IndexExistsException,
    IndexNotFoundException,
    PathExistsException,
    PathMismatchException,
    PathNotFoundException,
    ScopeExistsException,
    ValueInvalidException,
    ValueTooLargeException,
)
from ._grpc_status import GrpcCode, grpc_code, grpc_failure
from ._http import (
    SEARCH_QUOTA_LIMIT_MARKERS,
    SEARCH_RATE_LIMIT_MARKERS,
    analytics_retry_reason,
    query_retry_reason,
    search_exception,
    search_retry_reason,
    views_retry_reason,
)
from ._idempotency import (
    IDEMPOTENT_KV_OPCODES,
    HttpService,
    http_request,
    is_idempotent_http,
    is_idempotent_kv,
    kv_request,
)
from ._kv import (
    DCP_OPCODES,
    KV_RETRY_STATUSES,
    KvOpcode,
    KvStatus,
    kv_exception,
    kv_failure,
    kv_retry_reason,
)
from ._retry_after import parse_retry_after
from ._stage import FailureStage, dispatch_failure_reason, raise_failure, retry_allowed

__all__ = [
    "DCP_OPCODES",
    "IDEMPOTENT_KV_OPCODES",
    "KV_RETRY_STATUSES",
    "RETRY_ATTRIBUTES",
    "SEARCH_QUOTA_LIMIT_MARKERS",
    "SEARCH_RATE_LIMIT_MARKERS",
    "BucketExistsException",
    "BucketNotFoundException",
    "CollectionExistsException",
    "DocumentNotJsonException",
    "DocumentNotLockedException",
    "DocumentTooDeepException",
    "DurabilityAmbiguousException",
    "DurabilityImpossibleException",
    "DurabilityLevelNotAvailableException",
    "DurableWriteInProgressException",
    "DurableWriteReCommitInProgressException",
    "ErrorCode",
    "ErrorMap",
    "ErrorMapError",
    "FailureStage",
    "GrpcCode",
    "HttpService",
    "IndexExistsException",
    "IndexNotFoundException",
    "KvOpcode",
    "KvStatus",
    "PathExistsException",
    "PathMismatchException",
    "PathNotFoundException",
    "RetrySpec",
    "RetrySpecStrategy",
    "ScopeExistsException",
    "ValueInvalidException",
    "ValueTooLargeException",
    "analytics_retry_reason",
    "dispatch_failure_reason",
    "grpc_code",
    "grpc_failure",
    "http_request",
    "is_idempotent_http",
    "is_idempotent_kv",
    "kv_exception",
    "kv_failure",
    "kv_request",
    "kv_retry_reason",
    "parse_retry_after",
    "query_retry_reason",
    "raise_failure",
    "retry_allowed",
    "search_exception",
    "search_retry_reason",
    "views_retry_reason",
]
