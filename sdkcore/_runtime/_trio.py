"""The trio backend: trio's own cancel scope, clock and nursery."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, NoReturn

import trio

if sys.version_info < (3, 11):  # pragma: no cover - trio brings the backport there
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

if TYPE_CHECKING:
    from . import HedgeChain

__all__ = ["Hedges", "Scope", "now", "scope_left", "sleep"]

sleep = trio.sleep
now = trio.current_time


def scope_left() -> float:
    """Seconds left before the deadline of the cancel scopes enclosing the running task.

    ``trio.current_effective_deadline()`` (anyio's scopes on trio are trio's):
    ``math.inf`` without one (or outside a task), ``-inf`` once cancelled. It walks
    the task's scopes: about 1 us, so only ``Request.time_left`` and
    ``Request.dispatch_info()`` read it, never a door or ``Request()``.
    """
    try:
        deadline = trio.current_effective_deadline()
    except RuntimeError:  # trio's thread, but not in a task (a run_sync_soon callback)
        return math.inf
    if deadline == math.inf or deadline == -math.inf:
        return deadline
    return deadline - trio.current_time()


class Scope:
    """A ``trio.CancelScope`` entered at once and left by :meth:`exit` (same task, LIFO)."""

    __slots__ = ("_scope", "open")

    def __init__(self, deadline: float) -> None:
        self._scope = trio.CancelScope(deadline=deadline)
        self._scope.__enter__()
        self.open = True

    @property
    def fired(self) -> bool:
        return self._scope.cancel_called

    def cancelled_elsewhere(self) -> bool:
        """Whether a scope enclosing this one is cancelled (not this one: see ``fired``):
        the task's effective deadline is ``-inf``. See the asyncio backend."""
        return not self._scope.cancel_called and scope_left() == -math.inf

    def cancel(self) -> None:
        if self.open:
            self._scope.cancel()

    def exit(self, error: BaseException | None) -> bool:
        """See the asyncio backend: True when this scope cut the code."""
        self.open = False
        scope = self._scope
        if error is None:
            scope.__exit__(None, None, None)
        else:
            try:
                if scope.__exit__(type(error), error, error.__traceback__):
                    return True  # our own trio.Cancelled, swallowed by the scope
            except Exception:
                # A group of our Cancelled beside errors the cut code raised for it (a
                # nursery in send whose task reported the cut as "connection reset"): the
                # scope took its Cancelled out (``cancelled_caught``) and raised the rest.
                # Ours, as when the code raises its own error for the cut. (A rest holding
                # another cancellation is not an Exception, and trio's own errors, a
                # misnested scope, set no ``cancelled_caught``: they propagate.)
                if scope.cancelled_caught:
                    return True
                raise
        if not scope.cancel_called:
            return False
        # Cut while the code swallowed the cancellation, or raised its own error for it.
        return error is None or isinstance(error, Exception)


class Hedges:
    """The copies of one hedged request, run in a trio nursery (rfc/0004, "The runner").

    The caller's task schedules; every copy, hedge 0 included, is a child task of
    one nursery whose cancel scope carries the request's deadline and cuts the
    losers (and ``Request.cancel()``). Between two changes the caller waits on a
    ``trio.Event`` that every copy sets when it ends, bounded by when the next
    hedge is due. The nursery waits for every child: nothing outlives the call.
    """

    __slots__ = ("chain", "deadline", "event", "scope")

    def __init__(self, chain: HedgeChain, deadline: float) -> None:
        self.chain = chain
        chain.cutting = _cutting
        self.deadline = deadline  # on trio's clock (math.inf: none)
        self.scope: trio.CancelScope | None = None  # the nursery's, while it is open
        self.event: trio.Event | None = None

    def cancel(self) -> None:
        """``Request.cancel()``: cut every copy in flight."""
        self.chain.cut = True
        if self.scope is not None:
            self.scope.cancel()

    def _woken(self) -> None:
        event = self.event
        if event is not None:
            event.set()

    async def run(self) -> None:
        try:
            await self._run()
        except BaseExceptionGroup as group:
            _unwrap(group)

    async def _run(self) -> None:
        chain = self.chain
        chain.wake = self._woken
        try:
            async with trio.open_nursery() as nursery:
                scope = self.scope = nursery.cancel_scope
                scope.deadline = self.deadline
                if chain.cut:  # Request.cancel() before the nursery was open
                    scope.cancel()

                def start(attempt: object) -> None:
                    nursery.start_soon(self._copy, attempt)

                while True:
                    if not chain.over and (scope.cancel_called or now() >= self.deadline):
                        # Request.cancel() or the deadline, while this task was being woken:
                        # no copy is started after either (trio runs a woken task on).
                        chain.cut = True
                    when = math.inf if chain.cut else chain.send_due(start)
                    if chain.over or chain.cut:
                        if chain.outstanding:
                            scope.cancel()  # the losers, or every copy the cut left
                        break
                    if when == math.inf and not chain.outstanding:
                        break
                    event = self.event = trio.Event()
                    with trio.CancelScope(deadline=when):
                        await event.wait()
        finally:
            # Every copy has ended (the nursery waited for them): none wakes the caller
            # again. Kept, the chain's bound method and this runner would be a reference
            # cycle, the request and its copies freed only by the garbage collector.
            chain.wake = None
        self.scope = None
        if scope.cancel_called and not chain.over:  # the deadline or Request.cancel()
            chain.cut = True

    async def _copy(self, attempt: object) -> None:
        """One copy's task. trio starts every task it was given, also one whose scope was
        cancelled after the copy was booked (the caller's cancellation in the same turn),
        and runs it up to its first checkpoint: ``send`` would run until its first await.
        A task that begins cancelled sends nothing; the copy is booked as not sent."""
        chain = self.chain
        if trio.current_effective_deadline() == -math.inf:  # begun cancelled
            chain.skip(attempt)
            return
        await chain.run(attempt)


def _cutting(index: int) -> bool:
    """Whether the running copy's task is being cut (``_Chain.cutting``): its cancel scope,
    the nursery's or one around it (the deadline, ``Request.cancel()``, a winner, the
    caller's own cancellation, which reaches every copy on trio), is cancelled."""
    return trio.current_effective_deadline() == -math.inf


def _unwrap(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise what the caller would have seen without the nursery: one exception, not a group.

    The copies' own errors never reach the nursery (the chain books them), so a group
    holds only what cut them: the caller's cancellation (one ``trio.Cancelled`` per
    copy and one for the caller's wait), or a KeyboardInterrupt/SystemExit. The caller
    gets the first that is not a cancellation, else one ``Cancelled``, so its cancel
    scope catches it and ``except trio.Cancelled`` sees it, as on asyncio.
    """
    leaves: list[BaseException] = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        else:
            leaves.append(error)

    walk(group)
    for leaf in leaves:
        if not isinstance(leaf, trio.Cancelled):
            raise leaf from None
    raise leaves[0] from None
