"""RetryReason and its flag table (RFC 0049, "RetryReason").

One row of the RFC table is one member here; the flags are the RFC's columns.
``after_dispatch`` is sdkcore's own column: it says whether a failure with this
reason means the attempt may have reached the network, which gives the attempt's
default effect (see rfc/0001 and ``sdkcore._context.DEFAULT_EFFECT``).
"""

from __future__ import annotations

import enum

__all__ = ["RetryReason", "suggest_member"]


class RetryReason(enum.Enum):
    """Why a request is handed to the orchestrator.

    Each member carries three flags:

    * ``allows_non_idempotent_retry``: a non-idempotent request may be retried
      for this reason (the attempt provably did not change server state).
    * ``always_retry``: retried with controlled backoff whatever the strategy
      says (e.g. NOT_MY_VBUCKET).
    * ``after_dispatch``: the failed attempt may have been written to the
      network. It decides the attempt's default effect (``DEFAULT_EFFECT``, used
      when the failure names none): false, ``AttemptEffect.NOT_SENT``; true, sent
      (NOT_APPLIED when ``allows_non_idempotent_retry``, else MAYBE_APPLIED). Hence
      ``Request.reached_network``, and whether a retry spends the retry budget (a
      NOT_SENT attempt's does not). A timeout is ambiguous only for a request that is
      not idempotent and ``maybe_applied``, so this flag alone does not decide that.
    """

    # name = (value, allows_non_idempotent_retry, always_retry, after_dispatch)
    UNKNOWN = (1, False, False, True)
    SOCKET_NOT_AVAILABLE = (2, True, False, False)
    SERVICE_NOT_AVAILABLE = (3, True, False, False)
    NODE_NOT_AVAILABLE = (4, True, False, False)
    KV_NOT_MY_VBUCKET = (5, True, True, True)
    KV_COLLECTION_OUTDATED = (6, True, True, True)
    KV_ERROR_MAP_RETRY_INDICATED = (7, True, False, True)
    KV_LOCKED = (8, True, False, True)
    KV_TEMPORARY_FAILURE = (9, True, False, True)
    KV_SYNC_WRITE_IN_PROGRESS = (10, True, False, True)
    KV_SYNC_WRITE_RE_COMMIT_IN_PROGRESS = (11, True, False, True)
    SERVICE_RESPONSE_CODE_INDICATED = (12, True, False, True)
    SOCKET_CLOSED_WHILE_IN_FLIGHT = (13, False, False, True)
    CIRCUIT_BREAKER_OPEN = (14, True, False, False)
    QUERY_PREPARED_STATEMENT_FAILURE = (15, True, False, True)
    QUERY_INDEX_NOT_FOUND = (16, True, False, True)
    QUERY_ERROR_RETRYABLE = (17, True, False, True)
    QUERY_TRANSACTION_BUFFER_FULL = (18, True, False, True)
    ANALYTICS_TEMPORARY_FAILURE = (19, True, False, True)
    SEARCH_TOO_MANY_REQUESTS = (20, True, False, True)
    VIEWS_TEMPORARY_FAILURE = (21, True, False, True)
    VIEWS_NO_ACTIVE_PARTITION = (22, True, True, True)
    # The terminal reasons of "Fail Fast (Terminal Errors)": all are found
    # before the request is written, so they never reach the network.
    AUTHENTICATION_ERROR = (23, True, False, False)
    TLS_ERROR = (24, True, False, False)
    BUCKET_ACCESS_ERROR = (25, True, False, False)
    SCOPE_NOT_FOUND = (26, True, False, False)
    COLLECTION_NOT_FOUND = (27, True, False, False)
    # sdkcore's own load shedding (rfc/0009): refused by the client before anything was
    # written, so any request may retry (after the refusal's retry_after, if any).
    CONCURRENCY_LIMITED = (28, True, False, False)
    CLIENT_THROTTLED = (29, True, False, False)

    allows_non_idempotent_retry: bool
    always_retry: bool
    after_dispatch: bool

    def __new__(
        cls, value: int, allows_non_idempotent_retry: bool, always_retry: bool, after_dispatch: bool
    ) -> RetryReason:
        member = object.__new__(cls)
        member._value_ = value
        member.allows_non_idempotent_retry = allows_non_idempotent_retry
        member.always_retry = always_retry
        member.after_dispatch = after_dispatch
        return member

    # Members are singletons compared by identity: hash them by identity too
    # (C speed; Enum's default hashes the name in Python).
    __hash__ = object.__hash__

    # The flags are RFC 0049's table and must not be reassigned (AttemptEffect's defaults
    # are computed from them once). Not enforced: a __setattr__ refusing it cost 2,418
    # instructions (1.4%) of a retried execute, though no flag is ever written
    # (bench/README, "The ninth session's hot paths").

    def __repr__(self) -> str:
        return f"<RetryReason.{self.name}>"


def suggest_member(value: object, enum_type: type[enum.Enum]) -> str:
    """How a TypeError for a value that is not a member of ``enum_type`` ends.

    A member's name given as a string (``"SERVICE_NOT_AVAILABLE"``, any case) gets
    the spelling to use instead (``RetryReason.SERVICE_NOT_AVAILABLE``). For a
    reason, a server's status (another enum's member, e.g. ``KvStatus.LOCKED``) or an
    exception gets how to turn it into one; anything else gets an example member, never
    the most restrictive one (UNKNOWN).
    """
    cls = enum_type.__name__
    if isinstance(value, str):
        name = value.strip().upper().removeprefix(f"{cls.upper()}.")
        if name in enum_type.__members__:
            return f"; use {cls}.{name}, not the string {value!r}"
    if enum_type is RetryReason:
        if isinstance(value, BaseException):
            return (
                "; an exception is not a reason: raise it as RetryableError(reason, cause=...)"
                " when it is retryable, else end the request with it (orchestrator.fail)"
            )
        if isinstance(value, enum.Enum):
            return (
                f"; {type(value).__name__}.{value.name} is a status, not a retry reason: map "
                "it with sdkcore.mapping (kv_retry_reason, kv_failure, grpc_failure)"
            )
    example = _EXAMPLES.get(cls) or next(iter(enum_type.__members__))
    return f"; pass a member such as {cls}.{example}"


#: The member an error message shows as an example (by enum name): a common one, and
#: for an effect the cautious one.
_EXAMPLES = {"RetryReason": "KV_LOCKED", "AttemptEffect": "MAYBE_APPLIED"}
