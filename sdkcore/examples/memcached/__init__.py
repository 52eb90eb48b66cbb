"""A memcached binary-protocol client built on sdkcore: the example SDK maintainers copy.

* :class:`MemcachedClient` (async, asyncio and trio; pipelined, one connection per
  endpoint) and :class:`SyncMemcachedClient` (threads, through ``execute_sync``).
* Every operation is an :class:`sdkcore.Request` whose ``idempotent`` comes from its
  opcode (:func:`sdkcore.mapping.kv_request`), run by a
  :class:`~sdkcore.RetryOrchestrator`; server statuses go through
  :func:`sdkcore.mapping.kv_failure`.
* Each endpoint has a :class:`~sdkcore.CircuitBreaker`. A refused dispatch fails
  its attempt with ``RetryReason.CIRCUIT_BREAKER_OPEN`` (nothing was sent); when a
  dispatch is the breaker's probe, a NOOP goes first and its answer decides.

The protocol codec is in ``_protocol``, the shared dispatch rules in ``_endpoint``.
See rfc/0007-endpoint-protection.md.
"""

from ._client import MemcachedClient
from ._endpoint import endpoint_down, make_breaker, refuse_if_open
from ._protocol import ProtocolError, Response
from ._sync_client import SyncMemcachedClient

__all__ = [
    "MemcachedClient",
    "ProtocolError",
    "Response",
    "SyncMemcachedClient",
    "endpoint_down",
    "make_breaker",
    "refuse_if_open",
]
