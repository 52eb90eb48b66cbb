"""Exceptions only the failure mappers produce.

The common ones (DocumentNotFoundException, CasMismatchException, ...) live in
``sdkcore._errors``; these are the rarer SDK3 error names the KV status and gRPC
detail tables need. All subclass :class:`CouchbaseException`, so they take
``(message=None, *, context=None)`` like every sdkcore exception.
:class:`ValueTooLargeException` and :class:`ValueInvalidException` subclass
:class:`~sdkcore.InvalidArgumentException`: a gRPC INVALID_ARGUMENT whose details
name the value still surfaces as the invalid argument its status code says it is.
"""

from __future__ import annotations

from .._errors import CouchbaseException, InvalidArgumentException

__all__ = [
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
    "IndexExistsException",
    "IndexNotFoundException",
    "PathExistsException",
    "PathMismatchException",
    "PathNotFoundException",
    "ScopeExistsException",
    "ValueInvalidException",
    "ValueTooLargeException",
]


class DocumentNotLockedException(CouchbaseException):
    """Unlock of a document that is not locked (KV 0x0e, gRPC NOT_LOCKED)."""

    default_message = "document not locked"


class DocumentNotJsonException(CouchbaseException):
    default_message = "document is not JSON"


class DocumentTooDeepException(CouchbaseException):
    default_message = "document is too deeply nested"


class ValueTooLargeException(InvalidArgumentException):
    """The value is larger than the server accepts (KV 0x03, gRPC VALUE_TOO_LARGE)."""

    default_message = "value too large"


class ValueInvalidException(InvalidArgumentException):
    """The value is not valid for the operation (gRPC VALUE_OUT_OF_RANGE)."""

    default_message = "value invalid for this operation"


class PathNotFoundException(CouchbaseException):
    default_message = "sub-document path not found"


class PathExistsException(CouchbaseException):
    default_message = "sub-document path already exists"


class PathMismatchException(CouchbaseException):
    default_message = "sub-document path does not match the document structure"


class BucketNotFoundException(CouchbaseException):
    default_message = "bucket not found"


class BucketExistsException(CouchbaseException):
    default_message = "bucket already exists"


class ScopeExistsException(CouchbaseException):
    default_message = "scope already exists"


class CollectionExistsException(CouchbaseException):
    default_message = "collection already exists"


class IndexNotFoundException(CouchbaseException):
    default_message = "index not found"


class IndexExistsException(CouchbaseException):
    default_message = "index already exists"


class DurabilityLevelNotAvailableException(CouchbaseException):
    default_message = "durability level not available"


class DurabilityImpossibleException(CouchbaseException):
    default_message = "durability impossible with the current number of replicas"


class DurabilityAmbiguousException(CouchbaseException):
    """A synchronous write's outcome is unknown: it may or may not have been applied."""

    default_message = "durable write ambiguous: it may have been applied"


class DurableWriteInProgressException(CouchbaseException):
    default_message = "a durable write is in progress on this document"


class DurableWriteReCommitInProgressException(CouchbaseException):
    default_message = "a durable write re-commit is in progress on this document"
