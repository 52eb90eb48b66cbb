"""KV (memcached binary protocol) statuses and opcodes -> RetryReason or exception.

RFC 0049 "Response Code Retry List", KV part. :func:`kv_retry_reason` decides
whether a non-success response goes to the orchestrator; :func:`kv_exception` is
the error a response completes the request with when it does not;
:func:`kv_failure` is both in one call.
"""

from __future__ import annotations

import enum
from types import MappingProxyType

from .._context import AttemptEffect, ErrorContext
from .._errors import (
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
    ScopeNotFoundException,
    TemporaryFailureException,
)
from .._reason import RetryReason
from .._untrusted import show as _show
from ._error_map import ErrorMap
from ._exceptions import (
    BucketNotFoundException,
    DocumentNotLockedException,
    DurabilityAmbiguousException,
    DurabilityImpossibleException,
    DurabilityLevelNotAvailableException,
    DurableWriteInProgressException,
    DurableWriteReCommitInProgressException,
    ValueTooLargeException,
)

__all__ = [
    "DCP_OPCODES",
    "KV_RETRY_STATUSES",
    "KvOpcode",
    "KvStatus",
    "kv_exception",
    "kv_failure",
    "kv_retry_reason",
]


class KvStatus(enum.IntEnum):
    """The response statuses sdkcore gives a meaning to.

    A status outside this enum is "unknown" to sdkcore: only then is the KV
    error map consulted (RFC 0049 "KV Error Map Handling").
    """

    SUCCESS = 0x00
    KEY_NOT_FOUND = 0x01
    KEY_EXISTS = 0x02
    VALUE_TOO_LARGE = 0x03
    INVALID_ARGUMENTS = 0x04
    NOT_STORED = 0x05
    DELTA_BAD_VALUE = 0x06
    NOT_MY_VBUCKET = 0x07
    NO_BUCKET = 0x08
    LOCKED = 0x09
    NOT_LOCKED = 0x0E
    AUTH_ERROR = 0x20
    NO_ACCESS = 0x24
    RATE_LIMITED_NETWORK_INGRESS = 0x30
    RATE_LIMITED_NETWORK_EGRESS = 0x31
    RATE_LIMITED_MAX_CONNECTIONS = 0x32
    RATE_LIMITED_MAX_COMMANDS = 0x33
    SCOPE_SIZE_LIMIT_EXCEEDED = 0x34
    UNKNOWN_COMMAND = 0x81
    NO_MEMORY = 0x82
    NOT_SUPPORTED = 0x83
    INTERNAL_ERROR = 0x84
    BUSY = 0x85
    TEMPORARY_FAILURE = 0x86
    UNKNOWN_COLLECTION = 0x88
    UNKNOWN_SCOPE = 0x8C
    DURABILITY_INVALID_LEVEL = 0xA0
    DURABILITY_IMPOSSIBLE = 0xA1
    SYNC_WRITE_IN_PROGRESS = 0xA2
    SYNC_WRITE_AMBIGUOUS = 0xA3
    SYNC_WRITE_RE_COMMIT_IN_PROGRESS = 0xA4


class KvOpcode(enum.IntEnum):
    """Client opcodes (magic 0x80/0x08) sdkcore refers to, including every DCP opcode."""

    GET = 0x00
    SET = 0x01  # upsert
    ADD = 0x02  # insert
    REPLACE = 0x03
    DELETE = 0x04
    INCREMENT = 0x05
    DECREMENT = 0x06
    NOOP = 0x0A
    APPEND = 0x0E
    PREPEND = 0x0F
    STAT = 0x10
    TOUCH = 0x1C
    GET_AND_TOUCH = 0x1D
    HELLO = 0x1F
    SASL_LIST_MECHS = 0x20
    SASL_AUTH = 0x21
    SASL_STEP = 0x22
    GET_ALL_VB_SEQNOS = 0x48
    DCP_OPEN_CONNECTION = 0x50
    DCP_ADD_STREAM = 0x51
    DCP_CLOSE_STREAM = 0x52
    DCP_STREAM_REQUEST = 0x53
    DCP_GET_FAILOVER_LOG = 0x54
    DCP_STREAM_END = 0x55
    DCP_SNAPSHOT_MARKER = 0x56
    DCP_MUTATION = 0x57
    DCP_DELETION = 0x58
    DCP_EXPIRATION = 0x59
    DCP_FLUSH = 0x5A
    DCP_SET_VBUCKET_STATE = 0x5B
    DCP_NOOP = 0x5C
    DCP_BUFFER_ACKNOWLEDGEMENT = 0x5D
    DCP_CONTROL = 0x5E
    DCP_SYSTEM_EVENT = 0x5F
    DCP_PREPARE = 0x60
    DCP_SEQNO_ACKNOWLEDGED = 0x61
    DCP_COMMIT = 0x62
    DCP_ABORT = 0x63
    DCP_SEQNO_ADVANCED = 0x64
    DCP_OSO_SNAPSHOT = 0x65
    DCP_CACHED_VALUE = 0x66
    DCP_CACHED_KEY_META = 0x67
    DCP_CACHE_TRANSFER_END = 0x68
    GET_REPLICA = 0x83
    SELECT_BUCKET = 0x89
    OBSERVE_SEQNO = 0x91
    OBSERVE = 0x92
    GET_AND_LOCK = 0x94
    UNLOCK = 0x95
    GET_META = 0xA0
    GET_CLUSTER_CONFIG = 0xB5
    GET_RANDOM_KEY = 0xB6
    GET_COLLECTIONS_MANIFEST = 0xBA
    GET_COLLECTION_ID = 0xBB
    SUBDOC_GET = 0xC5
    SUBDOC_EXISTS = 0xC6
    SUBDOC_DICT_ADD = 0xC7
    SUBDOC_DICT_UPSERT = 0xC8
    SUBDOC_DELETE = 0xC9
    SUBDOC_REPLACE = 0xCA
    SUBDOC_ARRAY_PUSH_LAST = 0xCB
    SUBDOC_ARRAY_PUSH_FIRST = 0xCC
    SUBDOC_ARRAY_INSERT = 0xCD
    SUBDOC_ARRAY_ADD_UNIQUE = 0xCE
    SUBDOC_COUNTER = 0xCF
    SUBDOC_MULTI_LOOKUP = 0xD0
    SUBDOC_MULTI_MUTATION = 0xD1
    SUBDOC_GET_COUNT = 0xD2
    SUBDOC_REPLACE_BODY_WITH_XATTR = 0xD3
    RANGE_SCAN_CREATE = 0xDA
    RANGE_SCAN_CONTINUE = 0xDB
    RANGE_SCAN_CANCEL = 0xDC
    GET_ERROR_MAP = 0xFE

    @property
    def is_dcp(self) -> bool:
        return self.value in DCP_OPCODES


#: Every DCP opcode (0x50-0x68, up to kv_engine's cache-transfer messages).
#: DCP responses are never retry reasons.
DCP_OPCODES: frozenset[int] = frozenset(range(0x50, 0x69))

#: RFC 0049 KV rows: status -> reason (before the per-opcode exceptions below).
KV_RETRY_STATUSES: MappingProxyType[int, RetryReason] = MappingProxyType(
    {
        KvStatus.NOT_MY_VBUCKET.value: RetryReason.KV_NOT_MY_VBUCKET,
        KvStatus.UNKNOWN_COLLECTION.value: RetryReason.KV_COLLECTION_OUTDATED,
        KvStatus.LOCKED.value: RetryReason.KV_LOCKED,
        KvStatus.TEMPORARY_FAILURE.value: RetryReason.KV_TEMPORARY_FAILURE,
        KvStatus.BUSY.value: RetryReason.KV_TEMPORARY_FAILURE,
        KvStatus.SYNC_WRITE_IN_PROGRESS.value: RetryReason.KV_SYNC_WRITE_IN_PROGRESS,
        KvStatus.SYNC_WRITE_RE_COMMIT_IN_PROGRESS.value: (
            RetryReason.KV_SYNC_WRITE_RE_COMMIT_IN_PROGRESS
        ),
    }
)

# status -> (reason, opcodes for which the status is NOT retried). Precomputed so
# the hot path is two dict/set lookups.
_NO_RETRY_OPCODES: dict[int, frozenset[int]] = {
    KvStatus.UNKNOWN_COLLECTION.value: DCP_OPCODES | {KvOpcode.GET_COLLECTION_ID.value},
    KvStatus.LOCKED.value: DCP_OPCODES | {KvOpcode.UNLOCK.value},
}
_TABLE: dict[int, tuple[RetryReason, frozenset[int]]] = {
    status: (reason, _NO_RETRY_OPCODES.get(status, DCP_OPCODES))
    for status, reason in KV_RETRY_STATUSES.items()
}
_ERROR_MAP_RETRY = RetryReason.KV_ERROR_MAP_RETRY_INDICATED


def _check(value: object, what: str, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {_show(value)} ({type(value).__name__})")
    if not 0 <= value <= maximum:
        raise ValueError(f"{what} must be in 0..0x{maximum:x}, got {_show(value)}")
    return int(value)


def _check_error_map(value: object, what: str) -> None:
    if value is not None and not isinstance(value, ErrorMap):
        raise TypeError(
            f"{what} must be an sdkcore.mapping.ErrorMap (ErrorMap.from_json) or None, "
            f"got {_show(value)}"
        )


def _check_bool(value: object, what: str) -> None:
    if type(value) is not bool:
        raise TypeError(f"{what} must be a bool (True or False), got {_show(value)}")


def _check_context(value: object, what: str) -> None:
    if value is not None and not isinstance(value, ErrorContext):
        raise TypeError(f"{what} must be an sdkcore.ErrorContext or None, got {_show(value)}")


#: Statuses that do not prove the command changed nothing: the durable write may have
#: committed; an internal error says nothing of how far the command went.
_OUTCOME_UNKNOWN = frozenset({KvStatus.SYNC_WRITE_AMBIGUOUS, KvStatus.INTERNAL_ERROR})


def kv_retry_reason(
    status: int, opcode: int, error_map: ErrorMap | None = None
) -> RetryReason | None:
    """The RetryReason for a KV response, or None: complete the request with its error.

    * 0x07 NOT_MY_VBUCKET -> KV_NOT_MY_VBUCKET (every opcode);
    * 0x88 UNKNOWN_COLLECTION -> KV_COLLECTION_OUTDATED, except GET_COLLECTION_ID
      (0xbb), where it means the collection does not exist;
    * 0x09 LOCKED -> KV_LOCKED, except UNLOCK (0x95): see :func:`kv_exception`
      (CasMismatchException);
    * 0x86 TEMPORARY_FAILURE and 0x85 BUSY -> KV_TEMPORARY_FAILURE;
    * 0xa2 -> KV_SYNC_WRITE_IN_PROGRESS; 0xa4 -> KV_SYNC_WRITE_RE_COMMIT_IN_PROGRESS;
    * any other status (not success) whose ``error_map`` entry has ``retry-now`` or
      ``retry-later`` -> KV_ERROR_MAP_RETRY_INDICATED (an excluded pair of the rows
      above is final: the error map is not consulted for it);
    * 0xa3 SYNC_WRITE_AMBIGUOUS and 0x84 INTERNAL_ERROR -> None whatever the error map
      says: they do not prove the command changed nothing (the durable write may have
      committed), and KV_ERROR_MAP_RETRY_INDICATED retries even a non-idempotent write,
      booked not applied (rfc/0002);
    * everything else, success, and every DCP opcode -> None.

    ``error_map`` must be an :class:`ErrorMap` or None (TypeError otherwise).
    """
    if (
        type(status) is not int
        or type(opcode) is not int
        or not (0 <= status <= 0xFFFF and 0 <= opcode <= 0xFF)
        or (error_map is not None and type(error_map) is not ErrorMap)
    ):
        status = _check(status, "kv_retry_reason(status)", 0xFFFF)
        opcode = _check(opcode, "kv_retry_reason(opcode)", 0xFF)
        _check_error_map(error_map, "kv_retry_reason(error_map)")
    row = _TABLE.get(status)
    if row is not None:
        return None if opcode in row[1] else row[0]
    if error_map is None or status == 0 or opcode in DCP_OPCODES or status in _OUTCOME_UNKNOWN:
        return None
    return _ERROR_MAP_RETRY if status in error_map.retry_statuses else None


# -- the exception a KV failure completes with ---------------------------------------

_CAS_ON_EXISTS = frozenset({KvOpcode.REPLACE.value, KvOpcode.APPEND.value, KvOpcode.PREPEND.value})

_STATUS_EXCEPTIONS: dict[int, type[CouchbaseException]] = {
    KvStatus.KEY_NOT_FOUND: DocumentNotFoundException,
    KvStatus.VALUE_TOO_LARGE: ValueTooLargeException,
    KvStatus.INVALID_ARGUMENTS: InvalidArgumentException,
    KvStatus.DELTA_BAD_VALUE: InvalidArgumentException,
    KvStatus.NO_BUCKET: BucketNotFoundException,
    KvStatus.LOCKED: DocumentLockedException,
    KvStatus.NOT_LOCKED: DocumentNotLockedException,
    KvStatus.AUTH_ERROR: AuthenticationFailureException,
    KvStatus.NO_ACCESS: AuthenticationFailureException,
    KvStatus.RATE_LIMITED_NETWORK_INGRESS: RateLimitedException,
    KvStatus.RATE_LIMITED_NETWORK_EGRESS: RateLimitedException,
    KvStatus.RATE_LIMITED_MAX_CONNECTIONS: RateLimitedException,
    KvStatus.RATE_LIMITED_MAX_COMMANDS: RateLimitedException,
    KvStatus.SCOPE_SIZE_LIMIT_EXCEEDED: QuotaLimitedException,
    KvStatus.UNKNOWN_COMMAND: FeatureNotAvailableException,
    KvStatus.NOT_SUPPORTED: FeatureNotAvailableException,
    KvStatus.NO_MEMORY: TemporaryFailureException,
    KvStatus.INTERNAL_ERROR: InternalServerFailureException,
    KvStatus.BUSY: TemporaryFailureException,
    KvStatus.TEMPORARY_FAILURE: TemporaryFailureException,
    KvStatus.UNKNOWN_COLLECTION: CollectionNotFoundException,
    KvStatus.UNKNOWN_SCOPE: ScopeNotFoundException,
    KvStatus.DURABILITY_INVALID_LEVEL: DurabilityLevelNotAvailableException,
    KvStatus.DURABILITY_IMPOSSIBLE: DurabilityImpossibleException,
    KvStatus.SYNC_WRITE_IN_PROGRESS: DurableWriteInProgressException,
    KvStatus.SYNC_WRITE_AMBIGUOUS: DurabilityAmbiguousException,
    KvStatus.SYNC_WRITE_RE_COMMIT_IN_PROGRESS: DurableWriteReCommitInProgressException,
}


def _describe(status: int, opcode: int, error_map: ErrorMap | None) -> str:
    try:
        status_name = KvStatus(status).name
    except ValueError:
        entry = error_map.get(status) if error_map is not None else None
        status_name = entry.name if entry is not None else "unknown status"
    try:
        op_name = KvOpcode(opcode).name
    except ValueError:
        op_name = f"opcode 0x{opcode:02x}"
    return f"KV status 0x{status:02x} {status_name} on {op_name}"


def kv_exception(
    status: int,
    opcode: int,
    *,
    error_map: ErrorMap | None = None,
    with_cas: bool = False,
    context: ErrorContext | None = None,
) -> CouchbaseException:
    """The exception a KV request completes with for a non-success ``status``.

    * LOCKED on UNLOCK -> :class:`CasMismatchException` (RFC 0049: never retried);
      LOCKED elsewhere -> DocumentLockedException.
    * KEY_EXISTS -> CasMismatchException for REPLACE/APPEND/PREPEND or when the
      request carried a CAS (``with_cas=True``), else DocumentExistsException.
      NOT_STORED on ADD -> DocumentExistsException.
    * UNKNOWN_COLLECTION -> CollectionNotFoundException (e.g. on GET_COLLECTION_ID).
    * A status sdkcore does not know -> CouchbaseException naming the status and,
      when ``error_map`` has it, its name and description.

    The exception's ``effect`` is ``AttemptEffect.NOT_APPLIED`` when it maps to a specific
    exception (the server refused the command: it changed nothing), so a write answered
    "exists" is not reported maybe applied; None for SYNC_WRITE_AMBIGUOUS (the durable
    write may have committed), INTERNAL_ERROR (how far it went is unknown) and a status
    left as a plain CouchbaseException (one sdkcore does not know, NOT_STORED off ADD).

    ``status`` 0 (SUCCESS) raises ValueError: it is not a failure. ``error_map``
    must be an :class:`ErrorMap` or None, ``with_cas`` a bool and ``context`` an
    :class:`~sdkcore.ErrorContext` or None (TypeError otherwise).
    """
    status = _check(status, "kv_exception(status)", 0xFFFF)
    opcode = _check(opcode, "kv_exception(opcode)", 0xFF)
    if (
        (error_map is not None and type(error_map) is not ErrorMap)
        or type(with_cas) is not bool
        or (context is not None and type(context) is not ErrorContext)
    ):
        _check_error_map(error_map, "kv_exception(error_map)")
        _check_bool(with_cas, "kv_exception(with_cas)")
        _check_context(context, "kv_exception(context)")
    if status == KvStatus.SUCCESS:
        raise ValueError("kv_exception(status): 0x00 SUCCESS is not a failure")
    what = _describe(status, opcode, error_map)
    cls: type[CouchbaseException] | None
    if status == KvStatus.LOCKED and opcode == KvOpcode.UNLOCK:
        cls = CasMismatchException
    elif status == KvStatus.KEY_EXISTS:
        cas = with_cas or opcode in _CAS_ON_EXISTS
        cls = CasMismatchException if cas else DocumentExistsException
    elif status == KvStatus.NOT_STORED:
        cls = DocumentExistsException if opcode == KvOpcode.ADD else None
    else:
        cls = _STATUS_EXCEPTIONS.get(status)
    if cls is not None:
        error = cls(f"{cls.default_message} ({what})", context=context)
        if status not in _OUTCOME_UNKNOWN:
            # The server refused the command: it changed nothing (a KV command is all or
            # nothing), unlike a durable write whose outcome is unknown or an internal error.
            error.effect = AttemptEffect.NOT_APPLIED
        return error
    entry = error_map.get(status) if error_map is not None else None
    detail = f": {entry.desc}" if entry is not None and entry.desc else ""
    return CouchbaseException(f"KV request failed ({what}){detail}", context=context)


def kv_failure(
    status: int,
    opcode: int,
    error_map: ErrorMap | None = None,
    *,
    with_cas: bool = False,
    context: ErrorContext | None = None,
) -> RetryReason | CouchbaseException:
    """:func:`kv_retry_reason` if the response is retryable, else :func:`kv_exception`.

    Use it in a ``send`` for ``RetryOrchestrator.execute`` together with
    :func:`sdkcore.mapping.raise_failure`. The arguments are checked as there, also
    when the response is retryable (a bad ``with_cas`` or ``context`` is refused either way).
    """
    if (
        type(status) is not int
        or type(opcode) is not int
        or not (0 <= status <= 0xFFFF and 0 <= opcode <= 0xFF)
        or (error_map is not None and type(error_map) is not ErrorMap)
        or type(with_cas) is not bool
        or (context is not None and type(context) is not ErrorContext)
    ):
        status = _check(status, "kv_failure(status)", 0xFFFF)
        opcode = _check(opcode, "kv_failure(opcode)", 0xFF)
        _check_error_map(error_map, "kv_failure(error_map)")
        _check_bool(with_cas, "kv_failure(with_cas)")
        _check_context(context, "kv_failure(context)")
    reason = kv_retry_reason(status, opcode, error_map)
    if reason is not None:
        return reason
    return kv_exception(status, opcode, error_map=error_map, with_cas=with_cas, context=context)
