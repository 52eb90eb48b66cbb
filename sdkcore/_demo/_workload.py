"""The demo's workload: idempotent reads and non-idempotent writes through sdkcore's real paths.

Each operation is a :class:`~sdkcore.Request` run by ``RetryOrchestrator.execute``
(or ``RetryOrchestrator.hedge`` for hedged reads). Its ``send`` makes one gRPC call
on an ``sdkcore.grpc`` channel whose service config retries, per gRPC A6, what the
channel can safely retry on its own (pushback for every method; UNAVAILABLE for
reads only). What reaches ``send`` is mapped by :mod:`sdkcore.mapping`: KV statuses
in the reply with ``kv_failure``, gRPC statuses with ``grpc_failure``, a connection
lost after the request was written with ``dispatch_failure_reason(IN_FLIGHT)``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import attrs
import grpc
from grpc import aio

import sdkcore.grpc
from sdkcore import (
    AttemptEffect,
    BestEffortRetryStrategy,
    CouchbaseException,
    FastFailOnTerminalErrorRetryStrategy,
    HedgePolicy,
    Request,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
    TimeoutException,
)
from sdkcore.mapping import (
    FailureStage,
    KvOpcode,
    dispatch_failure_reason,
    grpc_failure,
    kv_failure,
    kv_request,
    raise_failure,
)

from . import SCENARIO_HELP
from ._metrics import CountingOrchestrator, Counts
from ._server import BAD_BUCKET, IN_FLIGHT_KEY, LOCKED_KEY, SERVICE, TroubledCluster

__all__ = [
    "OP_TIMEOUT",
    "SCENARIOS",
    "STRATEGIES",
    "STRATEGY_IDS",
    "GiveUpAfterSix",
    "OpResult",
    "Scenario",
    "run_scenario",
]

#: Every operation's timeout (seconds), across all its attempts.
OP_TIMEOUT = 0.6

#: Hedged reads: a second replica after this delay, two attempts in all.
HEDGE_DELAY = 0.02
HEDGE_ATTEMPTS = 2

#: The channel's service config (gRPC A6): the channel itself retries what is safe
#: for the method: RESOURCE_EXHAUSTED (the node refused the call; pushback honoured)
#: everywhere, UNAVAILABLE only for the idempotent reads. GetAnyReplica is hedged by
#: the channel (A6 hedgingPolicy).
_METHOD_CONFIGS: list[dict[str, Any]] = [
    {
        "name": [
            {"service": SERVICE, "method": "Get"},
            {"service": SERVICE, "method": "GetReplica"},
        ],
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.02s",
            "maxBackoff": "0.1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
        },
    },
    {
        "name": [{"service": SERVICE, "method": "Upsert"}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.02s",
            "maxBackoff": "0.1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["RESOURCE_EXHAUSTED"],
        },
    },
]
HEDGED_METHOD_CONFIG: dict[str, Any] = {
    "name": [{"service": SERVICE, "method": "GetAnyReplica"}],
    "hedgingPolicy": {
        "maxAttempts": HEDGE_ATTEMPTS,
        "hedgingDelay": f"{HEDGE_DELAY}s",
        "nonFatalStatusCodes": ["UNAVAILABLE"],
    },
}


#: The method the channel hedges (its hedgingPolicy).
_HEDGED = f"{SERVICE}/GetAnyReplica"

SERVICE_CONFIG = json.dumps({"methodConfig": [*_METHOD_CONFIGS, HEDGED_METHOD_CONFIG]})


class GiveUpAfterSix(BestEffortRetryStrategy):
    """A user's strategy: best effort, but at most six retries per request."""

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.retry_attempts >= 6:
            return RetryAction.no_retry()
        return await super().retry_after(request, reason)


#: (label shown to users, factory).
STRATEGIES: tuple[tuple[str, Callable[[], RetryStrategy]], ...] = (
    ("BestEffort", BestEffortRetryStrategy),
    ("FastFailOnTerminalError (default)", FastFailOnTerminalErrorRetryStrategy),
    ("GiveUpAfterSix (user strategy)", GiveUpAfterSix),
)
#: label -> the strategy's key in ``--json`` (stable snake_case; labels are for people).
STRATEGY_IDS: dict[str, str] = {
    "BestEffort": "best_effort",
    "FastFailOnTerminalError (default)": "fast_fail_on_terminal_error",
    "GiveUpAfterSix (user strategy)": "give_up_after_six",
}


@attrs.frozen(slots=True)
class Scenario:
    name: str
    #: What goes wrong, in a few words.
    title: str
    ops: int
    #: Seconds between the starts of two operations.
    spacing: float
    #: Every ``write_every``-th operation is a write (0: reads only).
    write_every: int = 2
    bucket: str = "travel"
    #: Reads go to replica 0 (the slow one) with GetReplica.
    replica_reads: bool = False
    hedged: bool = False
    #: Every write goes to this key (None: keys spread over both nodes).
    write_key: str | None = None


_T = SCENARIO_HELP
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("rebalance", _T["rebalance"], 24, 0.01),
    Scenario("locked", _T["locked"], 16, 0.015, write_key=LOCKED_KEY),
    Scenario("node-restart", _T["node-restart"], 24, 0.012),
    Scenario("overload", _T["overload"], 20, 0.01),
    Scenario("bad-credentials", _T["bad-credentials"], 8, 0.005, bucket=BAD_BUCKET),
    Scenario("slow-replica", _T["slow-replica"], 48, 0.006, write_every=0, replica_reads=True),
    Scenario(
        "hedged-reads",
        _T["hedged-reads"],
        48,
        0.006,
        write_every=0,
        replica_reads=True,
        hedged=True,
    ),
)


#: Hedged reads: two copies, the second after HEDGE_DELAY (replica ``index`` per copy).
HEDGE_POLICY = HedgePolicy(max_attempts=HEDGE_ATTEMPTS, delay=HEDGE_DELAY)


@attrs.frozen(slots=True)
class OpResult:
    """One operation's outcome."""

    write: bool
    ok: bool
    latency: float
    retries: int
    reasons: tuple[str, ...]
    #: The exception's class name, for failures.
    error: str | None = None
    #: ``str(exc)`` of the failure.
    message: str | None = None
    timeout: bool = False
    ambiguous: bool = False
    #: A failure that is not a sdkcore exception: a bug, reported as such.
    unexpected: bool = False
    #: Copies ``hedge()`` sent after the first (counted apart from retries).
    hedges: int = 0


class _Client:
    """The demo's tiny SDK: one channel, one orchestrator, the mapping in ``send``."""

    def __init__(
        self, channel: aio.Channel, orchestrator: RetryOrchestrator, counts: Counts
    ) -> None:
        self.channel = channel
        self.orchestrator = orchestrator
        self.counts = counts
        self._calls = {
            name: channel.unary_unary(f"/{SERVICE}/{name}")
            for name in ("Get", "Upsert", "GetReplica", "GetAnyReplica")
        }

    def _send(
        self, method: str, body: dict[str, Any], opcode: KvOpcode
    ) -> Callable[[Request], Awaitable[dict[str, Any]]]:
        call = self._calls[method]
        payload = json.dumps(body).encode()
        counts = self.counts

        async def send(request: Request) -> dict[str, Any]:
            counts.channel_calls += 1  # one channel call per attempt (per hedged copy)
            try:
                # No timeout of its own: made inside the request's send, the call is bounded
                # by the request's time left (rfc/0003, "A call inside a request").
                raw = await call(payload)
            except aio.AioRpcError as err:
                raise_failure(_map_status(err, request), cause=err)
            reply: dict[str, Any] = json.loads(raw)
            status = int(reply["status"])
            if status != 0:
                raise_failure(kv_failure(status, opcode))
            return reply

        return send

    async def get(self, request: Request, key: str, bucket: str) -> None:
        await self.orchestrator.execute(
            request, self._send("Get", {"bucket": bucket, "key": key}, KvOpcode.GET)
        )

    async def upsert(self, request: Request, key: str, op: str, bucket: str) -> None:
        body = {"bucket": bucket, "key": key, "op": op, "value": {"n": op}}
        await self.orchestrator.execute(request, self._send("Upsert", body, KvOpcode.SET))

    async def get_replica(self, request: Request, key: str, bucket: str) -> None:
        """Read replica 0 (the slow one)."""
        body = {"bucket": bucket, "key": key, "replica": 0}
        await self.orchestrator.execute(request, self._send("GetReplica", body, KvOpcode.GET))

    async def get_any_replica(self, request: Request, key: str, bucket: str) -> None:
        """Read from any replica, hedged by the channel's hedgingPolicy (hedge n: replica n)."""
        body = {"bucket": bucket, "key": key}
        await self.orchestrator.execute(request, self._send("GetAnyReplica", body, KvOpcode.GET))

    async def get_hedged(self, request: Request, key: str, bucket: str) -> None:
        """Read hedged by the generic runner: copy ``index`` asks replica ``index``."""
        sends = [
            self._send("GetReplica", {"bucket": bucket, "key": key, "replica": i}, KvOpcode.GET)
            for i in range(HEDGE_ATTEMPTS)
        ]

        async def send(request: Request, index: int) -> dict[str, Any]:
            return await sends[min(index, len(sends) - 1)](request)

        await self.orchestrator.hedge(request, send, HEDGE_POLICY)


def _map_status(err: aio.AioRpcError, request: Request) -> RetryReason | BaseException:
    """A failed call's status: a RetryReason for the orchestrator, or the exception."""
    trailing = err.trailing_metadata() or ()
    if any(k == IN_FLIGHT_KEY for k, _ in trailing):
        # Written, then the connection closed: retried only if idempotent (RFC 0049).
        return dispatch_failure_reason(FailureStage.IN_FLIGHT)
    code = err.code()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # Refused when the bucket's connection authenticated: the request never
        # reached the data service, and the strategy decides (FastFailOnTerminalError
        # fails at once, BestEffort keeps trying until the timeout). The server
        # answered, and an authentication refusal proves nothing was applied.
        return RetryableError(
            RetryReason.AUTHENTICATION_ERROR, err.details() or "", effect=AttemptEffect.NOT_APPLIED
        )
    # The channel's own A6 attempts for this call: the request's context counts only the
    # orchestrator's retries around the channel, so without them a call the channel tried
    # four times would read "retry_attempts": 0 (sdkcore.grpc.call_context, rfc/0003).
    channel = sdkcore.grpc.call_context(err)
    attempts = None if channel is None else channel.extra.get("grpc_attempts")
    context = None if attempts is None else request.error_context(extra={"grpc_attempts": attempts})
    return grpc_failure(code, err.details() or "", read_only=request.idempotent, context=context)


def _outcome(
    write: bool, request: Request, start: float, exc: BaseException | None, hedged: bool = False
) -> OpResult:
    """One operation's result. ``hedged``: sent through ``hedge()``, whose extra copies
    RFC 0049 counts in ``retry_attempts``; the report counts them as hedges, not retries."""
    latency = time.perf_counter() - start
    retries, hedges = (0, request.retry_attempts) if hedged else (request.retry_attempts, 0)
    seen = list(request.retry_reasons)
    last = getattr(getattr(exc, "context", None), "reason", None)
    if isinstance(last, RetryReason) and last not in seen:
        seen.append(last)  # the reason of the attempt that ended the request
    reasons = tuple(r.name for r in seen)
    if exc is None:
        return OpResult(write, True, latency, retries, reasons, hedges=hedges)
    return OpResult(
        write,
        False,
        latency,
        retries,
        reasons,
        error=type(exc).__name__,
        message=str(exc),
        timeout=isinstance(exc, TimeoutException),
        ambiguous=type(exc).__name__ == "AmbiguousTimeoutException",
        unexpected=not isinstance(exc, CouchbaseException),
        hedges=hedges,
    )


async def run_scenario(
    cluster: TroubledCluster,
    scenario: Scenario,
    strategy: RetryStrategy,
    run_id: str,
    on_done: Callable[[], None] = lambda: None,
    *,
    counts: Counts | None = None,
    telemetry: Any = None,
) -> tuple[list[OpResult], dict[str, int]]:
    """Run one scenario's operations under ``strategy``.

    Returns each operation's outcome and the channel's A6 retry counters
    (``{"retries": n, "hedges": h, "transparent": m}``; ``retries`` counts the
    hedging policy's copies too, as :class:`sdkcore.grpc.RetryStats` does). Every
    request (the warm-up's too) and channel call is added to ``counts``;
    ``telemetry`` (an :class:`sdkcore.Telemetry`, or None) records the
    orchestrator's requests and the channel's calls.
    """
    stats = sdkcore.grpc.RetryStats()
    results: list[OpResult] = []
    counts = Counts() if counts is None else counts
    orchestrator: RetryOrchestrator = CountingOrchestrator(
        counts, default_strategy=strategy, telemetry=telemetry
    )
    async with sdkcore.grpc.insecure_channel(
        cluster.target, service_config=SERVICE_CONFIG, stats=stats, telemetry=telemetry
    ) as channel:
        client = _Client(channel, orchestrator, counts)
        await channel.channel_ready()
        cluster.begin("warm-up")  # one untroubled call: connection and first-call costs
        await client.get(kv_request(KvOpcode.GET, timeout=OP_TIMEOUT), "warm_up", "travel")
        cluster.begin(scenario.name)

        async def one(i: int) -> None:
            await anyio.sleep(i * scenario.spacing)
            write = scenario.write_every > 0 and i % scenario.write_every == 1
            key = scenario.write_key if write and scenario.write_key else f"airline_{i % 12}"
            opcode = KvOpcode.SET if write else KvOpcode.GET
            name = "upsert" if write else ("get_replica" if scenario.replica_reads else "get")
            request = kv_request(opcode, name=name, timeout=OP_TIMEOUT)
            start = time.perf_counter()
            hedged = scenario.hedged and i % 2 == 0 and not write
            try:
                if write:
                    await client.upsert(request, key, f"{run_id}-{i}", scenario.bucket)
                elif hedged:
                    await client.get_hedged(request, key, scenario.bucket)
                elif scenario.hedged:
                    await client.get_any_replica(request, key, scenario.bucket)
                elif scenario.replica_reads:
                    await client.get_replica(request, key, scenario.bucket)
                else:
                    await client.get(request, key, scenario.bucket)
                results.append(_outcome(write, request, start, None, hedged))
            except Exception as exc:
                results.append(_outcome(write, request, start, exc, hedged))
            finally:
                on_done()

        async with anyio.create_task_group() as tg:
            for i in range(scenario.ops):
                tg.start_soon(one, i)
    snapshot = stats.snapshot()
    counters = snapshot.values()
    a6 = {
        "retries": sum(s.retry_attempts for s in counters),
        # The hedged method's "retries" are its hedges (it has no retryPolicy).
        "hedges": sum(s.retry_attempts for m, s in snapshot.items() if m.endswith(_HEDGED)),
        "transparent": sum(s.transparent_retries for s in counters),
    }
    counts.channel_retries += a6["retries"] - a6["hedges"]
    counts.channel_hedges += a6["hedges"]
    counts.channel_transparent_retries += a6["transparent"]
    return results, a6
