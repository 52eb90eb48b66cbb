"""RFC 0049 "Idempotent Operation List", and Request factories that apply it.

Every operation is non-idempotent unless listed:

* KV: Get, GetReplica, GetMeta, sub-document lookups (get, exists, get-count,
  multi-lookup), Noop, Observe, ObserveSeqno, GetCollectionID,
  GetCollectionsManifest, GetClusterConfig. Not GetAndLock, not GetAndTouch,
  no mutation.
* Query and analytics: when the request is ``readonly``.
* Search and views: always (read-only services).
* Management / cluster manager HTTP: GET only.
"""

from __future__ import annotations

import enum
from typing import Any

from .._request import Request
from .._untrusted import show as _show
from ._kv import KvOpcode

__all__ = [
    "IDEMPOTENT_KV_OPCODES",
    "HttpService",
    "http_request",
    "is_idempotent_http",
    "is_idempotent_kv",
    "kv_request",
]

#: The KV opcodes RFC 0049 lists as idempotent, and two reads it does not name that are
#: idempotent as well: GET_META and SUBDOC_GET_COUNT (rfc/0002).
IDEMPOTENT_KV_OPCODES: frozenset[int] = frozenset(
    op.value
    for op in (
        KvOpcode.GET,
        KvOpcode.GET_REPLICA,
        KvOpcode.GET_META,
        KvOpcode.SUBDOC_GET,
        KvOpcode.SUBDOC_EXISTS,
        KvOpcode.SUBDOC_GET_COUNT,
        KvOpcode.SUBDOC_MULTI_LOOKUP,
        KvOpcode.NOOP,
        KvOpcode.OBSERVE,
        KvOpcode.OBSERVE_SEQNO,
        KvOpcode.GET_COLLECTION_ID,
        KvOpcode.GET_COLLECTIONS_MANIFEST,
        KvOpcode.GET_CLUSTER_CONFIG,
    )
)


class HttpService(enum.Enum):
    QUERY = "query"
    ANALYTICS = "analytics"
    SEARCH = "search"
    VIEWS = "views"
    #: ns_server (cluster manager) and the management REST APIs.
    MANAGEMENT = "management"


_READONLY_SERVICES = frozenset({HttpService.QUERY, HttpService.ANALYTICS})
_HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _opcode(opcode: object, what: str) -> int:
    if isinstance(opcode, bool) or not isinstance(opcode, int):
        raise TypeError(
            f"{what} must be an int KV opcode, got {_show(opcode)} ({type(opcode).__name__})"
        )
    if not 0 <= opcode <= 0xFF:
        raise ValueError(f"{what} must be a KV opcode in 0..0xff, got {_show(opcode)}")
    return int(opcode)


def is_idempotent_kv(opcode: int) -> bool:
    """True exactly for :data:`IDEMPOTENT_KV_OPCODES` (RFC 0049's list, and two reads)."""
    if type(opcode) is int and 0 <= opcode <= 0xFF:
        return opcode in IDEMPOTENT_KV_OPCODES
    return _opcode(opcode, "is_idempotent_kv(opcode)") in IDEMPOTENT_KV_OPCODES


def _service(service: object, what: str) -> HttpService:
    if isinstance(service, HttpService):
        return service
    if isinstance(service, str):
        try:
            return HttpService(service.strip().lower())
        except ValueError:
            pass
    raise ValueError(
        f"{what} must be an HttpService or one of "
        f"{', '.join(s.value for s in HttpService)}, got {_show(service)}"
    )


def _method(method: object, what: str) -> str:
    if not isinstance(method, str):
        raise TypeError(f"{what} must be an HTTP method string, got {_show(method)}")
    upper = method.strip().upper()
    if upper not in _HTTP_METHODS:
        raise ValueError(
            f"{what} must be one of {', '.join(sorted(_HTTP_METHODS))}, got {_show(method)}"
        )
    return upper


def is_idempotent_http(service: HttpService | str, method: str, *, readonly: bool = False) -> bool:
    """RFC 0049 idempotency of an HTTP request.

    Query and analytics: ``readonly``. Search and views: always. Management: GET
    only. ``readonly=True`` is only meaningful for query and analytics; passing
    it for management raises ValueError (there the method decides).
    """
    svc = _service(service, "is_idempotent_http(service)")
    verb = _method(method, "is_idempotent_http(method)")
    if not isinstance(readonly, bool):
        raise TypeError(f"is_idempotent_http(readonly) must be a bool, got {_show(readonly)}")
    if svc in _READONLY_SERVICES:
        return readonly
    if svc is HttpService.MANAGEMENT:
        if readonly:
            raise ValueError(
                "is_idempotent_http(readonly=True) applies to query and analytics; "
                "a management request is idempotent exactly when its method is GET"
            )
        return verb == "GET"
    return True  # search, views


def _no_idempotent(kwargs: dict[str, Any], what: str) -> None:
    if "idempotent" in kwargs:
        raise TypeError(
            f"{what} sets Request.idempotent from RFC 0049's idempotent operation list; "
            "do not pass idempotent= (build a Request directly to override it)"
        )


def kv_request(opcode: int, **request_kwargs: Any) -> Request:
    """A :class:`Request` for a KV operation, ``idempotent`` set from the opcode.

    ``request_kwargs`` go to ``Request`` (``timeout``, ``retry_strategy``, ...);
    ``name`` defaults to ``"kv.<opcode name>"``.
    """
    op = _opcode(opcode, "kv_request(opcode)")
    _no_idempotent(request_kwargs, "kv_request")
    if "name" not in request_kwargs:
        try:
            request_kwargs["name"] = f"kv.{KvOpcode(op).name.lower()}"
        except ValueError:
            request_kwargs["name"] = f"kv.0x{op:02x}"
    return Request(idempotent=op in IDEMPOTENT_KV_OPCODES, **request_kwargs)


def http_request(
    service: HttpService | str, method: str, *, readonly: bool = False, **request_kwargs: Any
) -> Request:
    """A :class:`Request` for an HTTP service call, ``idempotent`` per :func:`is_idempotent_http`.

    ``name`` defaults to ``"<service>.<method>"`` (e.g. ``"query.post"``).
    """
    idempotent = is_idempotent_http(service, method, readonly=readonly)
    _no_idempotent(request_kwargs, "http_request")
    if "name" not in request_kwargs:
        svc = _service(service, "http_request(service)")
        request_kwargs["name"] = f"{svc.value}.{method.strip().lower()}"
    return Request(idempotent=idempotent, **request_kwargs)
