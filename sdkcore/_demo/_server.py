"""A small, troubled Couchbase-style cluster: an in-process grpc.aio server on 127.0.0.1.

The protocol is the demo's own, with JSON payloads over gRPC generic handlers (no
protobuf code generation). Every request names a ``bucket``, a ``key`` and, for
writes, an ``op`` id. KV-level results travel in the reply as a KV status
(``{"status": 7}`` is NOT_MY_VBUCKET), as a memcached-style server would send
them; node-level trouble is a gRPC status.

What goes wrong depends on the active scenario (:meth:`TroubledCluster.begin`) and
on the time since it began. Every write the server *applies* is counted per
``(key, op id)``: :meth:`TroubledCluster.duplicate_writes` is how the demo proves
that no non-idempotent write was applied twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections import Counter
from typing import Any

import grpc
from grpc import aio

__all__ = [
    "IN_FLIGHT_KEY",
    "SERVICE",
    "TroubledCluster",
]

SERVICE = "demo.Kv"

#: Trailing metadata saying the connection closed after the request was read. A KV
#: SDK learns this from its socket (the request was written); over gRPC the demo's
#: client reads it from this key instead.
IN_FLIGHT_KEY = "demo-connection"

#: The header gRPC A6 puts on every retry or hedge: how many attempts came before.
PREVIOUS_ATTEMPTS = "grpc-previous-rpc-attempts"

# KV statuses (memcached binary protocol).
_SUCCESS = 0x00
_NOT_MY_VBUCKET = 0x07
_LOCKED = 0x09

#: The document held locked (get-and-lock) by another client in scenario "locked".
LOCKED_KEY = "airline_10"
#: Bucket whose credentials the client has wrong in scenario "bad-credentials".
BAD_BUCKET = "billing"

#: Windows (seconds since the scenario began) during which things go wrong.
REBALANCE_WINDOW = 0.15
LOCK_WINDOW = 0.30
OUTAGE_WINDOW = 0.30
OVERLOAD_WINDOW = 0.20
PUSHBACK_MS = 40
#: In scenario "node-restart", this many writes to the failing node are applied
#: and then lose their connection before the reply.
IN_FLIGHT_LOSSES = 2
#: Slow replica: every SLOW_EVERY-th read of replica 0 takes SLOW_SECONDS. Odd, so
#: that reads alternating between two paths (hedged-reads) both meet the tail.
SLOW_EVERY = 7
SLOW_SECONDS = 0.30
FAST_SECONDS = 0.002


def vbucket(key: str) -> int:
    """The key's vbucket (of 8): CRC32 as in Couchbase, fewer buckets."""
    return zlib.crc32(key.encode()) % 8


def node_of(key: str) -> str:
    """Two nodes, A and B, each active for half of the vbuckets."""
    return "A" if vbucket(key) % 2 == 0 else "B"


class TroubledCluster:
    """The server and its troubles. ``async with`` starts and stops it."""

    def __init__(self) -> None:
        self.port = 0
        self.scenario = ""
        self._t0 = time.monotonic()
        self._server: Any = None
        #: (key, op id) -> times the write was applied.
        self.applied: Counter[tuple[str, str]] = Counter()
        #: Attempts the server saw, per method, in the current scenario.
        self.attempts: Counter[str] = Counter()
        self._replica_reads = 0
        self._lost_in_flight = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def begin(self, scenario: str) -> None:
        """Start a scenario: its trouble windows open now."""
        self.scenario = scenario
        self._t0 = time.monotonic()
        self.attempts.clear()
        self._replica_reads = 0
        self._lost_in_flight = 0

    def _since(self) -> float:
        return time.monotonic() - self._t0

    def duplicate_writes(self) -> list[tuple[str, str, int]]:
        """Writes applied more than once: (key, op id, times)."""
        return [(k, op, n) for (k, op), n in sorted(self.applied.items()) if n > 1]

    # -- handlers ----------------------------------------------------------------
    async def _node_trouble(self, request: dict[str, Any], context: Any, write: bool) -> None:
        """gRPC-level trouble common to every method: aborts the call (raises) or returns."""
        scenario, since = self.scenario, self._since()
        if request.get("bucket") == BAD_BUCKET:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"bucket {BAD_BUCKET!r}: authentication failed (wrong password)",
            )
        if scenario == "overload" and since < OVERLOAD_WINDOW:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(PUSHBACK_MS)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "node overloaded, back off")
        if scenario == "node-restart" and since < OUTAGE_WINDOW and node_of(request["key"]) == "B":
            if write and self._lost_in_flight < IN_FLIGHT_LOSSES:
                # The node applied the write, then went down before replying.
                self._lost_in_flight += 1
                self._apply(request)
                context.set_trailing_metadata(((IN_FLIGHT_KEY, "closed-in-flight"),))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset by node B")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node B is restarting")

    def _apply(self, request: dict[str, Any]) -> None:
        self.applied[(str(request["key"]), str(request["op"]))] += 1

    async def get(self, payload: bytes, context: Any) -> bytes:
        self.attempts["Get"] += 1
        request = json.loads(payload)
        await self._node_trouble(request, context, write=False)
        await asyncio.sleep(FAST_SECONDS)
        if self._moving(request["key"]):
            return _reply(_NOT_MY_VBUCKET)
        return _reply(_SUCCESS, {"key": request["key"], "value": "..."})

    async def upsert(self, payload: bytes, context: Any) -> bytes:
        self.attempts["Upsert"] += 1
        request = json.loads(payload)
        await self._node_trouble(request, context, write=True)
        await asyncio.sleep(FAST_SECONDS)
        if self._moving(request["key"]):
            return _reply(_NOT_MY_VBUCKET)
        if (
            self.scenario == "locked"
            and request["key"] == LOCKED_KEY
            and self._since() < LOCK_WINDOW
        ):
            return _reply(_LOCKED)
        self._apply(request)
        return _reply(_SUCCESS, {"key": request["key"]})

    async def get_replica(self, payload: bytes, context: Any) -> bytes:
        self.attempts["GetReplica"] += 1
        request = json.loads(payload)
        await self._node_trouble(request, context, write=False)
        return await self._read_replica(request, int(request.get("replica", 0)))

    async def get_any_replica(self, payload: bytes, context: Any) -> bytes:
        """A read any replica may answer: the n-th copy (A6 hedge n) goes to replica n."""
        self.attempts["GetAnyReplica"] += 1
        request = json.loads(payload)
        await self._node_trouble(request, context, write=False)
        metadata = dict(context.invocation_metadata() or ())
        return await self._read_replica(request, int(metadata.get(PREVIOUS_ATTEMPTS, 0)))

    async def _read_replica(self, request: dict[str, Any], replica: int) -> bytes:
        delay = FAST_SECONDS
        if replica == 0:
            self._replica_reads += 1
            if self._replica_reads % SLOW_EVERY == 0:
                delay = SLOW_SECONDS  # the slow replica's long tail
        await asyncio.sleep(delay)
        return _reply(_SUCCESS, {"key": request["key"], "replica": replica})

    def _moving(self, key: str) -> bool:
        """Rebalance: half of the vbuckets are moving during the window."""
        return (
            self.scenario == "rebalance" and self._since() < REBALANCE_WINDOW and (vbucket(key) < 4)
        )

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        handlers = {
            "Get": grpc.unary_unary_rpc_method_handler(self.get),
            "Upsert": grpc.unary_unary_rpc_method_handler(self.upsert),
            "GetReplica": grpc.unary_unary_rpc_method_handler(self.get_replica),
            "GetAnyReplica": grpc.unary_unary_rpc_method_handler(self.get_any_replica),
        }

        class Generic(grpc.GenericRpcHandler):  # type: ignore[misc]
            def service(self, details: Any) -> Any:
                service, _, method = details.method.lstrip("/").partition("/")
                return handlers.get(method) if service == SERVICE else None

        self._server = aio.server()
        self._server.add_generic_rpc_handlers((Generic(),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    async def __aenter__(self) -> TroubledCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _reply(status: int, body: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"status": status, **(body or {})}).encode()
