"""What both memcached clients share: endpoints, their breakers, and the KV mapping.

The guard an SDK copies is :func:`refuse_if_open` plus the NOOP canary: ask the
endpoint's breaker before anything is written, send a cheap NOOP first when this
dispatch is the probe, and report every outcome. See rfc/0007.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    AdaptiveThrottle,
    CircuitBreaker,
    CircuitState,
    ConcurrencyLimiter,
    RetryableError,
    RetryReason,
    TimeoutException,
    describe_error,
)
from sdkcore.mapping import kv_failure, raise_failure

from ._protocol import Response

__all__ = [
    "Address",
    "EndpointGuards",
    "Limiter",
    "endpoint_down",
    "endpoint_guards",
    "make_breaker",
    "parse_address",
    "per_endpoint",
    "pick",
    "raise_for_status",
    "refuse_if_open",
]

Address = tuple[str, int]
Limiter = ConcurrencyLimiter | AdaptiveConcurrencyLimiter
_LIMITERS = (ConcurrencyLimiter, AdaptiveConcurrencyLimiter)


def endpoint_down(error: BaseException) -> bool:
    """The memcached example's breaker rule: a timeout, or any connection that failed.

    The library's default rule already counts timeouts and an endpoint that refused,
    reset or closed the connection before the reply. This client connects on demand,
    inside the guarded dispatch, so any other ``OSError`` there (a name that does
    not resolve) is the endpoint being down too; a stream that broke reaches the
    breaker as the client's own ``ConnectionResetError``. A server that answers,
    with any status, is alive. A dispatch cut by its request's deadline reaches the
    breaker as that timeout (``CircuitBreaker.record_failure`` finds the request).
    """
    # TimeoutError is an OSError; asyncio.TimeoutError is a separate class on Python 3.10
    return isinstance(error, (OSError, TimeoutException, asyncio.TimeoutError))


def make_breaker(name: str) -> CircuitBreaker:
    """The default breaker of one endpoint (Couchbase's numbers, :func:`endpoint_down`)."""
    return CircuitBreaker(name=name, is_failure=endpoint_down)


def parse_address(address: str | Address) -> Address:
    if isinstance(address, tuple):
        host, port = address
    elif isinstance(address, str):
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit():
            raise ValueError(f"endpoint must be 'host:port' or (host, port), got {address!r}")
        port = int(port_text)
    else:
        raise TypeError(f"endpoint must be 'host:port' or (host, port), got {address!r}")
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"endpoint must be 'host:port' or (host, port), got {address!r}")
    return host, port


def pick(key: bytes | str, count: int) -> int:
    """The endpoint index for ``key`` (crc32, as memcached clients commonly hash)."""
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return zlib.crc32(raw) % count if count > 1 else 0


def refuse_if_open(breaker: CircuitBreaker) -> bool:
    """:meth:`CircuitBreaker.guard` split in two for a NOOP canary: True when this is the probe.

    Raises ``RetryableError(CIRCUIT_BREAKER_OPEN)`` when the breaker refuses: nothing
    was written, so the attempt is unambiguous and any request may be retried.
    """
    admitted = breaker.admit()
    if admitted is None:
        # As CircuitBreaker.guard() does: while OPEN, the retry waits for the probe.
        state = breaker.state
        wait = breaker.probe_after() if state is CircuitState.OPEN else None
        raise RetryableError(  # the words of CircuitBreaker.guard()'s refusal
            RetryReason.CIRCUIT_BREAKER_OPEN,
            f"circuit breaker {breaker.name} is {state.name}: nothing was sent",
            retry_after=wait,
        )
    return admitted is CircuitState.HALF_OPEN


def raise_for_status(response: Response, opcode: int) -> None:
    """Map a non-success status with sdkcore's KV mapper (RFC 0049): retry or fail."""
    if response.status:
        detail = response.value[:200].decode("utf-8", "replace")
        raise_failure(
            kv_failure(response.status, opcode),
            cause=ServerSaid(detail),
        )


class ServerSaid(Exception):
    """The text memcached put in an error response (the cause of the mapped error)."""


def canary_failed(breaker: CircuitBreaker, error: BaseException) -> NoReturn:
    """The NOOP probe failed: the breaker is OPEN again, the user's request was not sent.

    The probe's error is in the message, not chained: a chained cause becomes the
    attempt's ``last_error`` and the logs' ``caused_by``, which then read as this
    request's own connection failing in flight, hiding that nothing was sent.
    """
    raise RetryableError(
        RetryReason.CIRCUIT_BREAKER_OPEN,
        f"the NOOP canary to {breaker.name} failed ({describe_error(error)}); nothing was sent",
        retry_after=breaker.probe_after(),
    ) from None


def canary_bound(breaker: CircuitBreaker, time_left: float | None) -> float:
    """How long the canary may take: ``canary_timeout``, and never past the request's deadline.

    ``time_left``: the request's ``dispatch_info().time_left`` (seconds; None without a
    deadline), which also holds a deadline inherited from an enclosing request.
    """
    bound = breaker.canary_timeout.total_seconds()
    if time_left is not None:
        bound = min(bound, time_left)
    return bound


def endpoints_of(
    endpoints: str | Address | Sequence[str | Address],
) -> list[Address]:
    if isinstance(endpoints, (str, tuple)):
        endpoints = [endpoints]
    addresses = [parse_address(e) for e in endpoints]
    if not addresses:
        raise ValueError("endpoints must name at least one memcached server")
    return addresses


BreakerFactory = Callable[[str], CircuitBreaker]


def per_endpoint(client: str, given: Any, kind: Any, field: str, name: str, count: int) -> Any:
    """The guard of endpoint ``name``: ``given`` itself, or what ``given(name)`` makes.

    ``client``: the class named in errors (``MemcachedClient``, ``SyncMemcachedClient``).
    """
    if given is None:
        return None
    what = (
        "a ConcurrencyLimiter or AdaptiveConcurrencyLimiter"
        if field == "limiter"
        else ("an AdaptiveThrottle")
    )
    if isinstance(given, kind):
        if count > 1:
            raise ValueError(
                f"{client}({field}) is one {type(given).__name__} for {count} endpoints; "
                f"give a callable making one per endpoint name, e.g. lambda name: ...(name=name)"
            )
        return given
    if callable(given):
        made = given(name)
        if not isinstance(made, kind):
            raise TypeError(f"{client}({field}) made {made!r} for {name}; it must make {what}")
        return made
    raise TypeError(
        f"{client}({field}) must be {what}, a callable making one from the endpoint's "
        f"name, or None; got {given!r}"
    )


def endpoint_guards(
    client: str,
    addresses: Sequence[Address],
    breaker: BreakerFactory,
    limiter: Limiter | Callable[[str], Limiter] | None,
    throttle: AdaptiveThrottle | Callable[[str], AdaptiveThrottle] | None,
) -> list[tuple[Address, CircuitBreaker, Limiter | None, AdaptiveThrottle | None]]:
    """Per address, in the order given: its breaker, limiter and throttle (see
    :func:`per_endpoint`). ``client``: the class named in errors."""
    count = len(addresses)
    guards = []
    for address in addresses:
        name = f"{address[0]}:{address[1]}"
        guards.append(
            (
                address,
                breaker(name),
                per_endpoint(client, limiter, _LIMITERS, "limiter", name, count),
                per_endpoint(client, throttle, AdaptiveThrottle, "throttle", name, count),
            )
        )
    return guards


class EndpointGuards:
    """The guards of a client's endpoints, in the order given (for diagnostics)."""

    _endpoints: Sequence[Any]

    @property
    def breakers(self) -> list[CircuitBreaker]:
        """The breaker of each endpoint."""
        return [endpoint.breaker for endpoint in self._endpoints]

    @property
    def limiters(self) -> list[Limiter | None]:
        """The concurrency limiter of each endpoint (None without one)."""
        return [endpoint.limiter for endpoint in self._endpoints]

    @property
    def throttles(self) -> list[AdaptiveThrottle | None]:
        """The throttle of each endpoint (None without one)."""
        return [endpoint.throttle for endpoint in self._endpoints]
