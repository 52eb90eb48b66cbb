"""A fixed concurrency limit per endpoint: a bulkhead (rfc/0009, "Concurrency limiter").

resilience4j's ``Bulkhead`` and Polly's concurrency limiter: at most ``limit``
dispatches in flight; the next one is refused at once (``guard()``) or waits in a
FIFO queue of at most ``max_queued`` callers (``acquire()``), never past the
deadline of the request being sent. A refusal is a ``RetryableError`` raised before
anything is written: the attempt was not sent, so a retry is safe even for a
non-idempotent request.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from ._callables import clock_reading, sync_callable
from ._permits import TOKEN, Permits, permits, text

__all__ = ["ConcurrencyLimiter", "LimiterGuard"]


class ConcurrencyLimiter(Permits):
    """At most ``limit`` dispatches in flight to one endpoint.

    * ``with limiter.guard():`` around a dispatch (sync or async code, any thread):
      a permit if one is free and nobody is queued for one, else
      ``RetryableError(CONCURRENCY_LIMITED)`` at once, effect ``NOT_SENT``.
    * ``async with limiter.acquire():`` (asyncio or trio): the same, but when every
      permit is held the caller waits in a FIFO queue of at most ``max_queued``
      callers (0, the default: refused at once, as ``guard()``). The wait ends with
      the permit, or with a refusal shortly before the deadline of the request being
      sent (inside ``execute``, ``hedge``, ``attempt()``): a tenth of the time it had
      left when it queued, at least 2 ms and at most 20 ms, before it; or with the
      caller's cancellation, which is re-raised. A caller that leaves the queue
      never takes a permit with it nor holds up the ones behind. A caller handed its
      permit takes one checkpoint with it before its block runs, so a cancellation
      requested as the permit arrived (``Request.cancel()``, a hedge cutting its
      losers) cuts it there, nothing sent, and the permit goes to the next in line.

    The permit is given back when the block ends, however it ends (an exception,
    a cancellation, ``KeyboardInterrupt``; not an interrupt landing inside the
    limiter's own enter or exit, which keeps it: rfc/0009). ``limit``, ``in_flight`` and ``queued``
    are read without a lock (gauges). Thread-safe and loop-agnostic: one limiter per
    endpoint, shared by every door, thread and event loop. ``name`` (e.g.
    ``"10.0.0.1:11210"``) is in the refusal's message and is the ``limiter`` field of
    the events (``""`` when unnamed).

    Events: ``limiter.refusing`` (warning) at the first refusal after a permit was granted
    (``limit``, ``in_flight``, ``queued``), and ``limiter.recovered`` at the first permit
    granted a quiet second (``EPISODE_QUIET``) or more after the last refusal: a permit
    granted between two refusals does not end the episode (``refused``: the refusals
    in it, ``duration_ms``: since the first of them, on ``clock``, seconds, monotonic,
    default ``time.monotonic``).
    """

    __slots__ = ("_acquirer", "_clock", "_guard")

    def __init__(
        self,
        limit: int,
        *,
        max_queued: int = 0,
        name: str = "",
        clock: Callable[[], float] | None = None,
    ) -> None:
        what = "ConcurrencyLimiter"
        cap = permits(limit, f"{what}(limit)", 1)
        queue = permits(max_queued, f"{what}(max_queued)", 0)
        sync_callable(clock, f"{what}(clock)", "() -> seconds", optional=True)
        if clock is not None:
            clock_reading(clock, f"{what}(clock)")  # a clock that returns no seconds: here
        Permits.__init__(self, cap, queue, text(name, f"{what}(name)"), clock)
        # One guard and one acquirer per limiter, shared by every dispatch: a fixed
        # limit keeps nothing per dispatch (no allocation per call).
        self._guard = LimiterGuard(self)
        self._acquirer = LimiterAcquire(self)

    @property
    def limit(self) -> int:
        return self._cap

    def guard(self) -> LimiterGuard:
        """``with limiter.guard():``: a permit now, or a refusal (no queue)."""
        return self._guard

    def acquire(self) -> LimiterAcquire:
        """``async with limiter.acquire():``: a permit, waiting in line if ``max_queued`` allows."""
        return self._acquirer

    def __repr__(self) -> str:
        label = f" {self._name!r}" if self._name else ""
        return (
            f"<ConcurrencyLimiter{label} limit={self._cap} in_flight={self.in_flight} "
            f"queued={len(self._waiters)} max_queued={self._max_queued}>"
        )


class LimiterGuard:
    """What :meth:`ConcurrencyLimiter.guard` returns: a permit on enter, given back on exit.

    A plain class holding the limiter's token list and queue (never replaced): taking
    a permit is one ``list.pop()``, giving it back one ``list.append()``.
    """

    __slots__ = ("_limiter", "_tokens", "_waiters")

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self._limiter = limiter
        self._tokens = limiter._tokens
        self._waiters = limiter._waiters

    def __enter__(self) -> None:
        if not self._waiters:  # never ahead of a queued caller
            try:
                self._tokens.pop()
            except IndexError:
                pass
            else:
                if self._limiter._shedding:  # the first permit after refusals (else False)
                    self._limiter._regained()
                return
        raise self._limiter._full()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._tokens.append(TOKEN)
        if self._waiters:  # after the append: a caller queued before it is served now
            self._limiter._settle()


class LimiterAcquire:
    """What :meth:`ConcurrencyLimiter.acquire` returns: ``async with`` waits in line."""

    __slots__ = ("_limiter", "_tokens", "_waiters")

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self._limiter = limiter
        self._tokens = limiter._tokens
        self._waiters = limiter._waiters

    async def __aenter__(self) -> None:
        if not self._waiters:
            try:
                self._tokens.pop()
            except IndexError:
                pass
            else:
                if self._limiter._shedding:
                    self._limiter._regained()
                return
        await self._limiter._queue()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._tokens.append(TOKEN)
        if self._waiters:
            self._limiter._settle()
