"""Couchbase's gRPC protocol: status code + rich error details -> RetryReason or exception.

Works without grpcio: the code may be a ``grpc.StatusCode`` (anything with
``.name`` and ``.value[0]``), an int 0..16, or a name (case-insensitive, with or
without a ``StatusCode.`` prefix).

Status details
--------------
``details`` is an iterable of google.rpc error details, each either

* a mapping in the protobuf JSON form of ``google.protobuf.Any``: an ``"@type"``
  key (``"type.googleapis.com/google.rpc.PreconditionFailure"``; any prefix up to
  the last ``/`` is ignored) plus the message's fields, in JSON (``resourceType``)
  or proto (``resource_type``) spelling::

      {"@type": "type.googleapis.com/google.rpc.PreconditionFailure",
       "violations": [{"type": "LOCKED", "subject": "...", "description": "..."}]}
      {"@type": "type.googleapis.com/google.rpc.ResourceInfo",
       "resourceType": "document", "resourceName": "..."}
      {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "CAS_MISMATCH"}

* or a decoded message object with the same attributes (``violations[i].type``,
  ``resource_type``, ``resource_name``, ``reason``), e.g. from
  ``google.rpc.error_details_pb2`` after ``Any.Unpack``. Its type is taken from
  ``DESCRIPTOR.full_name`` or else the class name.

* or a packed ``google.protobuf.Any`` (``any_pb2.Any``, e.g. the entries of
  ``google.rpc.Status.details``): a mapping whose ``"@type"`` is
  ``google.protobuf.Any``, an object with ``type_url`` and ``value`` attributes,
  or one whose type resolves to ``google.protobuf.Any``. It is unpacked when
  ``google.rpc.error_details_pb2`` (googleapis-common-protos) is importable and
  its ``type_url`` names a message defined there; the protobuf JSON of an Any
  holding an Any (``{"@type": ".../google.protobuf.Any", "value": {...}}``) is
  unwrapped without protobuf. Any other packed Any raises TypeError naming
  ``details[i]``: skipping it could hide a LOCKED violation and lose the retry.
  Bytes that do not decode raise ValueError.

Details of other types (DebugInfo, RequestInfo, ...) are skipped. A LOCKED
violation in any PreconditionFailure decides first (KV_LOCKED); otherwise the
first detail that decides wins (for a PreconditionFailure, its first violation
of a known type); when none does, the status code decides.
ValueTooLargeException and ValueInvalidException subclass InvalidArgumentException,
so under INVALID_ARGUMENT / OUT_OF_RANGE the detail refines the code's exception
instead of contradicting it.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from .._context import AttemptEffect, ErrorContext
from .._errors import (
    AmbiguousTimeoutException,
    AuthenticationFailureException,
    CasMismatchException,
    CollectionNotFoundException,
    CouchbaseException,
    DocumentExistsException,
    DocumentNotFoundException,
    FeatureNotAvailableException,
    InternalServerFailureException,
    InvalidArgumentException,
    RateLimitedException,
    RequestCanceledException,
    RetryableError,
    ScopeNotFoundException,
    UnambiguousTimeoutException,
)
from .._reason import RetryReason
from .._untrusted import show as _show
from ._exceptions import (
    BucketExistsException,
    BucketNotFoundException,
    CollectionExistsException,
    DocumentNotJsonException,
    DocumentNotLockedException,
    DocumentTooDeepException,
    IndexExistsException,
    IndexNotFoundException,
    PathExistsException,
    PathMismatchException,
    PathNotFoundException,
    ScopeExistsException,
    ValueInvalidException,
    ValueTooLargeException,
)

__all__ = ["STATUS_REASONS", "GrpcCode", "grpc_code", "grpc_failure", "grpc_status_reason"]


class GrpcCode(enum.IntEnum):
    """gRPC status codes (same values as ``grpc.StatusCode``)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


_BY_VALUE = tuple(GrpcCode)
_BY_NAME = {c.name: c for c in GrpcCode}


def grpc_code(code: object) -> GrpcCode:
    """Normalise a ``grpc.StatusCode``, an int or a name to :class:`GrpcCode`."""
    if isinstance(code, GrpcCode):
        return code
    if isinstance(code, bool):
        raise TypeError(
            f"gRPC status code must be a grpc.StatusCode, int or name, got {_show(code)}"
        )
    if isinstance(code, int):
        if 0 <= code <= 16:
            return _BY_VALUE[code]
        raise ValueError(f"gRPC status code must be 0..16, got {_show(code)}")
    if isinstance(code, str):
        key = code.strip().upper()
        if key.startswith("STATUSCODE."):
            key = key[len("STATUSCODE.") :]
        found = _BY_NAME.get(key)
        if found is None:
            raise ValueError(
                f"unknown gRPC status code name {_show(code)}; "
                f"expected one of {', '.join(_BY_NAME)}"
            )
        return found
    value = getattr(code, "value", None)  # grpc.StatusCode: value == (int, "name")
    if isinstance(value, tuple) and value and isinstance(value[0], int) and hasattr(code, "name"):
        return grpc_code(value[0])
    raise TypeError(
        f"gRPC status code must be a grpc.StatusCode, int or name, got {_show(code)} "
        f"({type(code).__name__})"
    )


# -- status -> RetryReason: the one table both gRPC paths use ---------------------------

#: The RetryReason a failed gRPC call is handed to the orchestrator for, by status.
#: Used by :func:`grpc_failure` (for the statuses Couchbase retries on its own:
#: UNAVAILABLE) and by ``sdkcore.grpc`` channels (for the statuses a method's A6
#: ``retryableStatusCodes`` lists), so a status is logged under the same reason on
#: both paths. UNAVAILABLE is SERVICE_NOT_AVAILABLE (RFC 0049: the service is not
#: available; gRPC: "most likely a transient condition"); every other status is
#: SERVICE_RESPONSE_CODE_INDICATED: the response code itself asked for the retry.
#: Both allow retrying a non-idempotent call: A6 decides by status code alone.
STATUS_REASONS: Mapping[GrpcCode, RetryReason] = MappingProxyType(
    {
        code: (
            RetryReason.SERVICE_NOT_AVAILABLE
            if code is GrpcCode.UNAVAILABLE
            else RetryReason.SERVICE_RESPONSE_CODE_INDICATED
        )
        for code in GrpcCode
        if code is not GrpcCode.OK
    }
)


def grpc_status_reason(code: object) -> RetryReason:
    """The RetryReason of a retry after a failed call with status ``code``.

    ``code`` as for :func:`grpc_code`. ``OK`` raises ValueError: it is not a failure.
    """
    status = grpc_code(code)
    try:
        return STATUS_REASONS[status]
    except KeyError:
        raise ValueError("grpc_status_reason(code): OK is not a failure") from None


# -- details ---------------------------------------------------------------------------

_PRECONDITION_FAILURE = "google.rpc.PreconditionFailure"
_RESOURCE_INFO = "google.rpc.ResourceInfo"
_ERROR_INFO = "google.rpc.ErrorInfo"
_ANY = "google.protobuf.Any"
_SHORT_NAMES = {
    "PreconditionFailure": _PRECONDITION_FAILURE,
    "ResourceInfo": _RESOURCE_INFO,
    "ErrorInfo": _ERROR_INFO,
    "Any": _ANY,
}

# PreconditionFailure violation type -> exception; LOCKED (checked first) is the one
# retry reason.
_PRECONDITIONS: dict[str, type[CouchbaseException]] = {
    "NOT_LOCKED": DocumentNotLockedException,
    "PATH_MISMATCH": PathMismatchException,
    "DOC_NOT_JSON": DocumentNotJsonException,
    "DOC_TOO_DEEP": DocumentTooDeepException,
    "VALUE_OUT_OF_RANGE": ValueInvalidException,
    "VALUE_TOO_LARGE": ValueTooLargeException,
}
_NOT_FOUND: dict[str, type[CouchbaseException]] = {
    "document": DocumentNotFoundException,
    "bucket": BucketNotFoundException,
    "scope": ScopeNotFoundException,
    "collection": CollectionNotFoundException,
    "queryindex": IndexNotFoundException,
    "searchindex": IndexNotFoundException,
    "analyticsindex": IndexNotFoundException,
    "path": PathNotFoundException,
}
_EXISTS: dict[str, type[CouchbaseException]] = {
    "document": DocumentExistsException,
    "bucket": BucketExistsException,
    "scope": ScopeExistsException,
    "collection": CollectionExistsException,
    "queryindex": IndexExistsException,
    "searchindex": IndexExistsException,
    "analyticsindex": IndexExistsException,
    "path": PathExistsException,
}


def _field(detail: Any, *names: str) -> Any:
    if isinstance(detail, Mapping):
        for name in names:
            if name in detail:
                return detail[name]
        return None
    for name in names:
        value = getattr(detail, name, None)
        if value is not None:
            return value
    return None


def _detail_type(detail: Any, index: int) -> str:
    if isinstance(detail, Mapping):
        type_url = detail.get("@type")
        if not isinstance(type_url, str):
            raise ValueError(
                f'grpc_failure(details): details[{index}] is a mapping without an "@type" '
                'string; expected e.g. {"@type": '
                '"type.googleapis.com/google.rpc.PreconditionFailure", ...}'
            )
        return type_url.rsplit("/", 1)[-1]
    descriptor = getattr(detail, "DESCRIPTOR", None)
    full_name = getattr(descriptor, "full_name", None)
    if isinstance(full_name, str):
        return full_name
    name = type(detail).__name__
    return _SHORT_NAMES.get(name, name)


# A JSON Any holding an Any holding ... is unwrapped this many levels at most.
_MAX_ANY_NESTING = 8


def _packed_any_error(index: int, type_url: object, why: str) -> TypeError:
    inner = f" holding {_show(type_url)}" if isinstance(type_url, str) and type_url else ""
    return TypeError(
        f"grpc_failure(details): details[{index}] is a packed google.protobuf.Any{inner} "
        f"and must be unpacked ({why}); pass the message from Any.Unpack into its "
        "google.rpc.error_details_pb2 class, or its protobuf JSON mapping"
    )


def _unpack_bytes(index: int, type_url: object, value: object) -> Any:
    """Decode a packed Any's bytes into its google.rpc.error_details_pb2 message."""
    if not isinstance(type_url, str) or not isinstance(value, (bytes, bytearray, memoryview)):
        raise _packed_any_error(index, type_url, "its type_url or value is missing")
    full_name = type_url.rsplit("/", 1)[-1]
    try:
        # Optional dependency (googleapis-common-protos); imported only when needed.
        module = importlib.import_module("google.rpc.error_details_pb2")
    except ImportError:
        raise _packed_any_error(
            index, type_url, "google.rpc.error_details_pb2 is not installed"
        ) from None
    prefix = "google.rpc."
    cls = getattr(module, full_name[len(prefix) :], None) if full_name.startswith(prefix) else None
    descriptor = getattr(cls, "DESCRIPTOR", None)
    if cls is None or getattr(descriptor, "full_name", None) != full_name:
        raise _packed_any_error(index, type_url, "not a known google.rpc error detail type")
    message = cls()
    try:
        message.ParseFromString(bytes(value))
    except Exception as exc:  # protobuf's DecodeError, or a stand-in's own error
        raise ValueError(
            f"grpc_failure(details): details[{index}] is a packed {full_name} that "
            f"could not be decoded: {exc}"
        ) from exc
    return message


def _resolve(detail: Any, index: int) -> tuple[str, Any]:
    """``(type name, detail)`` with any packed ``google.protobuf.Any`` unwrapped."""
    for _ in range(_MAX_ANY_NESTING):
        if isinstance(detail, Mapping):
            kind = _detail_type(detail, index)
            if kind != _ANY:
                return kind, detail
            value = detail.get("value")
            if isinstance(value, Mapping):
                detail = value  # protobuf JSON of an Any whose payload is an Any
                continue
            type_url = detail.get("type_url", detail.get("typeUrl"))
            detail = _unpack_bytes(index, type_url, value)
            continue
        kind = _detail_type(detail, index)
        type_url = getattr(detail, "type_url", None)
        if kind == _ANY or (type_url is not None and hasattr(detail, "value")):
            detail = _unpack_bytes(index, type_url, getattr(detail, "value", None))
            continue
        return kind, detail
    raise _packed_any_error(index, None, f"nested more than {_MAX_ANY_NESTING} levels deep")


def _violations(kind: str, detail: Any) -> tuple[Any, ...]:
    """A PreconditionFailure's violations, read once (they may come from an iterator)."""
    if kind != _PRECONDITION_FAILURE:
        return ()
    violations = _field(detail, "violations")
    if isinstance(violations, (str, bytes, Mapping)) or not isinstance(violations, Iterable):
        return ()
    return tuple(violations)


def _from_detail(
    kind: str,
    detail: Any,
    violations: tuple[Any, ...],
    code: GrpcCode,
    describe: str,
    context: ErrorContext | None,
) -> CouchbaseException | None:
    if kind == _PRECONDITION_FAILURE:
        for violation in violations:
            vtype = _field(violation, "type")
            cls = _PRECONDITIONS.get(vtype) if isinstance(vtype, str) else None
            if cls is not None:
                return cls(f"{cls.default_message} ({describe})", context=context)
        return None
    if kind == _RESOURCE_INFO:
        rtype = _field(detail, "resourceType", "resource_type")
        table = (
            _NOT_FOUND
            if code is GrpcCode.NOT_FOUND
            else (_EXISTS if code is GrpcCode.ALREADY_EXISTS else None)
        )
        cls = table.get(rtype) if table is not None and isinstance(rtype, str) else None
        if cls is None:
            return None
        rname = _field(detail, "resourceName", "resource_name")
        named = f" {_show(rname)}" if rname else ""
        return cls(f"{cls.default_message}:{named} ({describe})", context=context)
    if kind == _ERROR_INFO:
        if _field(detail, "reason") == "CAS_MISMATCH":
            return CasMismatchException(
                f"{CasMismatchException.default_message} ({describe})", context=context
            )
        return None
    return None


def grpc_failure(
    code: object,
    message: str = "",
    details: Iterable[Any] = (),
    *,
    read_only: bool = False,
    context: ErrorContext | None = None,
) -> RetryableError | CouchbaseException:
    """Map a failed Couchbase gRPC call to the exception its ``send`` raises.

    A :class:`~sdkcore.RetryableError` hands the attempt to the orchestrator (the
    strategy decides); a :class:`~sdkcore.CouchbaseException` completes the request.
    Raise either with :func:`sdkcore.mapping.raise_failure` (or ``raise``).

    Ambiguity (rfc/0002 "Attempt effect"): the status was received from the
    server, and gRPC does not promise that a failed status means nothing was
    applied. A RetryableError for a status therefore carries
    ``effect=AttemptEffect.MAYBE_APPLIED``, as an ``sdkcore.grpc`` channel records
    it: a non-idempotent write that failed with UNAVAILABLE is not retried
    (RequestCanceledException, NO_MORE_RETRIES, saying it may have been applied). Only
    a LOCKED precondition violation, which by Couchbase's protocol means the
    document was locked and the mutation refused, is ``NOT_APPLIED``.

    Details first (see the module docstring for the accepted format, packed
    ``google.protobuf.Any`` included): a LOCKED violation in any
    PreconditionFailure -> RetryableError(KV_LOCKED), before every other detail;
    then, in order, the first deciding detail: PreconditionFailure -> the
    exception of its first known violation type (NOT_LOCKED, PATH_MISMATCH,
    DOC_NOT_JSON, DOC_TOO_DEEP, VALUE_OUT_OF_RANGE, VALUE_TOO_LARGE); ResourceInfo
    with NOT_FOUND / ALREADY_EXISTS -> the NotFound / Exists exception of the
    resource type (document, bucket, scope, collection, queryindex, searchindex,
    analyticsindex, path); ErrorInfo CAS_MISMATCH -> CasMismatchException.
    Then the code: UNAVAILABLE -> RetryableError(SERVICE_NOT_AVAILABLE, the reason
    an ``sdkcore.grpc`` channel logs it under); CANCELLED ->
    RequestCanceledException; DEADLINE_EXCEEDED ->
    UnambiguousTimeoutException if ``read_only`` else AmbiguousTimeoutException;
    NOT_FOUND -> DocumentNotFoundException; ALREADY_EXISTS ->
    DocumentExistsException; UNAUTHENTICATED, PERMISSION_DENIED ->
    AuthenticationFailureException; UNIMPLEMENTED -> FeatureNotAvailableException;
    INVALID_ARGUMENT, OUT_OF_RANGE -> InvalidArgumentException; ABORTED, UNKNOWN,
    INTERNAL -> InternalServerFailureException; RESOURCE_EXHAUSTED ->
    RateLimitedException; anything else -> CouchbaseException.

    In a hand-wired loop, pass the RetryableError's ``reason`` and ``effect`` to
    ``RetryOrchestrator.maybe_retry(request, failure.reason, effect=failure.effect)``.

    ``OK`` raises ValueError: it is not a failure. A packed Any that cannot be
    unpacked raises TypeError naming ``details[i]``.
    """
    status = grpc_code(code)
    if status is GrpcCode.OK:
        raise ValueError("grpc_failure(code): OK is not a failure")
    if not isinstance(read_only, bool):
        raise TypeError(f"grpc_failure(read_only) must be a bool, got {_show(read_only)}")
    if not isinstance(message, str):
        raise TypeError(f"grpc_failure(message) must be a str, got {type(message).__name__}")
    if context is not None and not isinstance(context, ErrorContext):
        raise TypeError(
            f"grpc_failure(context) must be an sdkcore.ErrorContext or None, got {_show(context)}"
        )
    if isinstance(details, (str, bytes, Mapping)) or not isinstance(details, Iterable):
        raise TypeError(
            "grpc_failure(details) must be an iterable of status details (mappings with "
            f'"@type" or decoded google.rpc messages), got {type(details).__name__}'
        )
    resolved = []
    for index, raw in enumerate(details):
        kind, detail = _resolve(raw, index)
        resolved.append((kind, detail, _violations(kind, detail)))
    # LOCKED is the one retry reason among the details: it wins wherever it is.
    describe = f"gRPC {status.name}: {message}" if message else f"gRPC {status.name}"
    for _, _, violations in resolved:
        if any(_field(violation, "type") == "LOCKED" for violation in violations):
            # Couchbase's protocol: the document is locked, the mutation was refused.
            return RetryableError(RetryReason.KV_LOCKED, describe, effect=AttemptEffect.NOT_APPLIED)
    for kind, detail, violations in resolved:
        decided = _from_detail(kind, detail, violations, status, describe, context)
        if decided is not None:
            return decided
    if status in _RETRIED:
        # Received from the server (or from something on the way that answers like
        # one): gRPC makes no promise that nothing was applied.
        return RetryableError(STATUS_REASONS[status], describe, effect=AttemptEffect.MAYBE_APPLIED)
    if status is GrpcCode.DEADLINE_EXCEEDED:
        if read_only:
            # Nobody knows whether it ran: unambiguous because running it again changes
            # nothing, not because it was not applied (the core's own wording for it).
            return UnambiguousTimeoutException(
                "request timed out; it may have reached the server, but it is read-only, so "
                f"it is safe to retry (unambiguous) ({describe})",
                context=context,
            )
        return AmbiguousTimeoutException(
            f"{AmbiguousTimeoutException.default_message} ({describe})", context=context
        )
    cls = _BY_CODE.get(status, CouchbaseException)
    return cls(f"{cls.default_message} ({describe})", context=context)


#: Statuses a Couchbase gRPC call is retried for without details deciding otherwise.
_RETRIED = frozenset({GrpcCode.UNAVAILABLE})

_BY_CODE: dict[GrpcCode, type[CouchbaseException]] = {
    GrpcCode.CANCELLED: RequestCanceledException,
    GrpcCode.NOT_FOUND: DocumentNotFoundException,
    GrpcCode.ALREADY_EXISTS: DocumentExistsException,
    GrpcCode.UNAUTHENTICATED: AuthenticationFailureException,
    GrpcCode.PERMISSION_DENIED: AuthenticationFailureException,
    GrpcCode.UNIMPLEMENTED: FeatureNotAvailableException,
    GrpcCode.INVALID_ARGUMENT: InvalidArgumentException,
    GrpcCode.OUT_OF_RANGE: InvalidArgumentException,
    GrpcCode.ABORTED: InternalServerFailureException,
    GrpcCode.UNKNOWN: InternalServerFailureException,
    GrpcCode.INTERNAL: InternalServerFailureException,
    GrpcCode.RESOURCE_EXHAUSTED: RateLimitedException,
}
