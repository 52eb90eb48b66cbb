"""The asyncio backend: one shared deadline timer per loop, the task's own cancellation.

Deadlines. Every request's deadline goes into one heap per event loop, with one loop
timer armed at the earliest (the way Java core-io keeps every timeout in one shared
timer). Arming a deadline is one ``heappush``; disarming it marks the entry closed,
and closed entries are dropped when the timer reaches them, or all at once as soon
as they outnumber the open ones (a burst of long timeouts is not held until they
pass). Measured in bench/bench_runtime.py: a deadline adds about 0.8 us to a
``Scope`` this way (1.4 us in all, 0.6 us of it the task lookup and the object),
against 1.5 us for a loop timer per call (``loop.call_at`` + ``cancel``) and 7 us
for an anyio cancel scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import HedgeChain

__all__ = ["Hedges", "Scope", "now", "sleep"]

sleep = asyncio.sleep


def now() -> float:
    return asyncio.get_running_loop().time()


class _Deadlines:
    """The deadlines of one event loop: a heap of (when, seq, scope) and one loop timer.

    ``closed`` counts the entries still in the heap whose scope has exited: once
    they outnumber the open ones (and there are at least ``_COMPACT_MIN``), the heap
    is rebuilt without them. Each rebuild drops at least half of the heap, so it
    costs amortised O(1) per deadline, and a finished burst leaves at most
    ``_COMPACT_MIN`` closed entries behind.
    """

    __slots__ = ("armed_at", "closed", "handle", "heap", "loop", "seq")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, Scope]] = []
        self.seq = itertools.count()
        self.handle: asyncio.TimerHandle | None = None
        self.armed_at = math.inf
        self.closed = 0

    def add(self, when: float, scope: Scope) -> None:
        heapq.heappush(self.heap, (when, next(self.seq), scope))
        if when < self.armed_at:
            self._arm(when)

    def close(self) -> None:
        """A scope with an entry in the heap exited: its entry is now closed."""
        closed = self.closed = self.closed + 1
        if closed >= _COMPACT_MIN and 2 * closed > len(self.heap):
            heap = self.heap
            heap[:] = [entry for entry in heap if entry[2].open]
            heapq.heapify(heap)
            self.closed = 0

    def _arm(self, when: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.armed_at = when
        self.handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.handle = None
        self.armed_at = math.inf
        heap = self.heap
        current = self.loop.time()
        while heap:
            when, _, scope = heap[0]
            if scope.open and when > current:
                self._arm(when)
                return
            heapq.heappop(heap)
            if scope.open:
                scope._queued = None  # fired: its exit closes no entry
                scope.cancel()
            else:
                self.closed -= 1


#: Below this many closed entries the heap is never rebuilt (64 entries of ~150 B:
#: what a rebuild saves is then worth less than the rebuild).
_COMPACT_MIN = 64

#: Tasks count their cancellations (``Task.cancelling()``/``uncancel()``, Python 3.11+).
_COUNTS = sys.version_info >= (3, 11)

_local = threading.local()  # the running loop's _Deadlines (one running loop per thread)

#: Tasks cut by a Scope that has not exited yet (one count per cut): every such cut is
#: taken back at the scope's exit, so a scope around it need not wait for it
#: (``Scope._hold``). Written only when a scope cuts and when it exits after a cut.
#: Weak keys: a task cut and never run again (its loop closed) is not kept.
_CUTS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


#: The message of a Scope's own ``Task.cancel()`` (see _alone).
_CUT = (
    "sdkcore cut it: the request's deadline, Request.cancel(), or the end of a hedge "
    "another copy decided"
)


def _alone(error: BaseException | None) -> bool:
    """Whether ``error`` stands for the scope's own cancellation, delivered apart from any
    other: that cancellation itself, or an error raised while handling it (a ``send``
    that turned it into a ``RetryableError``, a connection error), with no other
    cancellation right behind it (its ``__context__``, as anyio follows it).

    A cancellation of the task from elsewhere requested in the turn of the scope's, before
    the task ran, comes as one ``CancelledError`` with the last message requested (rfc/0001):
    not this. One requested later reached the code as a cancellation of its own, so an
    error standing for the scope's alone means the code took that one in and went on with
    the scope's: anyio's task group does, waiting for its tasks (``anyio.connect_tcp``'s),
    and the caller's anyio scope would not know the scope's cancellation for its own
    (:meth:`Scope.exit` then reports its own cut, when that was an anyio scope's:
    ``Scope._took_in``).
    """
    cut = error
    for _ in range(64):  # the cancellation an error was raised for (a context chain is short)
        if cut is None or not isinstance(cut, Exception):
            break
        cut = cut.__context__
    if type(cut) is not asyncio.CancelledError or cut.args != (_CUT,):
        return False
    return not isinstance(cut.__context__, asyncio.CancelledError)


def _anyio_pending(task: Any) -> int:
    """The cancellations anyio's scopes sent ``task`` and will take back as they exit
    (anyio 4's own count, per scope; 0 when anyio's asyncio backend is not loaded, or
    keeps no such count: the cancellation then propagates as the caller's, as before).

    anyio's bookkeeping is private (``_task_states``, ``_pending_uncancellations``): read
    only on this rare path, each name with a fallback. sdkcore never loads the backend
    (as ``_request._scope_left``): without it there is no anyio scope.
    """
    backend = sys.modules.get("anyio._backends._asyncio")
    try:
        state = getattr(backend, "_task_states", {}).get(task)
    except Exception:  # an anyio that keeps them otherwise
        return 0
    scope = getattr(state, "cancel_scope", None)
    total = 0
    for _ in range(1000):  # the task's scopes, innermost first (bounded all the same)
        if scope is None:
            break
        if getattr(scope, "_host_task", None) is task:
            count = getattr(scope, "_pending_uncancellations", None)
            if type(count) is int:
                total += count
        scope = getattr(scope, "_parent_scope", None)
    return total


def _taken_back(task: Any) -> None:
    left = _CUTS.pop(task, 1) - 1
    if left:
        _CUTS[task] = left


def _deadlines(loop: asyncio.AbstractEventLoop) -> _Deadlines:
    deadlines: _Deadlines | None = getattr(_local, "deadlines", None)
    if deadlines is None or deadlines.loop is not loop:
        deadlines = _local.deadlines = _Deadlines(loop)
    return deadlines


class Scope:
    """A deadline (and ``cancel()``) for the code the current task runs until :meth:`exit`.

    When the deadline passes, or :meth:`cancel` is called, the task is cancelled
    (``Task.cancel()``); :meth:`exit` then takes that cancellation back
    (``Task.uncancel()`` on 3.11+) and says the scope cut the code. A cancellation
    of the task from elsewhere is not taken for the scope's own on 3.11+ (3.10
    cannot count cancellations: there one racing the scope's is taken for it), except
    anyio scopes' that the code took in, going on with the scope's alone (``_took_in``).
    """

    __slots__ = ("_anyio", "_base", "_cuts", "_held", "_queued", "_sent", "_task", "fired", "open")

    def __init__(self, deadline: float) -> None:
        task: Any = asyncio.current_task()
        if task is None:
            raise RuntimeError("sdkcore needs to run inside an asyncio task")
        self._task = task
        self.fired = False
        self.open = True
        # The task's cancellations requested before the scope opened (0 on 3.10):
        # exit() takes back its own and leaves any requested since, even one that
        # arrived in the turn the scope fired and was delivered as one with it (as
        # asyncio.timeout counts from its enter). Counted at the send instead, a
        # caller's call.cancel() landing just before the scope's own cut was lost.
        base = self._base = task.cancelling() if _COUNTS else 0
        # Of those, the cuts of sdkcore scopes around this one (looked up only when there
        # are any: a task being cancelled as the scope opens, a cleanup request).
        self._cuts = _CUTS.get(task, 0) if base else 0
        # ... and anyio's scopes' (read the same way; see _took_in).
        self._anyio = _anyio_pending(task) if base else 0
        # False until this scope calls Task.cancel() (from inside its code, it is sent
        # at the loop's next turn, see cancel()).
        self._sent = False
        # Whether the cut waited a turn for a cancellation from elsewhere (_hold).
        self._held = False
        # The loop's deadlines while this scope has an entry in their heap.
        self._queued: _Deadlines | None = None
        if deadline != math.inf:
            deadlines = self._queued = _deadlines(task.get_loop())
            deadlines.add(deadline, self)

    def cancel(self) -> None:
        """Cut what runs in the scope now (the deadline, or ``Request.cancel()``), or a
        turn later when the task is being cancelled from elsewhere (:meth:`_hold`)."""
        if self.open and not self.fired:
            task: Any = self._task  # open: the task is there
            if self._hold(task, self.cancel):
                return
            self.fired = True
            if asyncio.current_task() is not task:
                self._send(task)
            else:
                # From inside the scope's own code (a send calling Request.cancel()):
                # cancelling the running task now would escape the scope if the code
                # returned without awaiting, so the cancellation goes at the loop's next
                # turn, if the code is still inside the scope then (as trio cuts it at its
                # next checkpoint). Returned before: the door sees ``fired``.
                asyncio.get_running_loop().call_soon(self._send_if_open)

    def _hold(self, task: Any, then: Callable[[], None]) -> bool:
        """Whether to cut a turn later (calling ``then``): once, when a cancellation of the
        task from elsewhere (the caller's anyio scope, its ``Task.cancel()``; not the cut
        of another sdkcore scope, which takes its own back at its exit, see ``_CUTS``)
        was requested since the scope opened (3.11+).

        Such a cancellation may not have reached the task yet, and sent in the same turn
        the scope's would take its place: at a bare checkpoint or a done future asyncio
        keeps one cancel message, the last requested, and anyio's cancel scope knows its
        own cancellation by its message. The caller's scope then let its own cancellation
        escape it (a fuzz seed, about once in 300 runs; rfc/0009). A turn later it has
        reached the task (its step was queued before this callback): the code is leaving
        the scope on it, or took it back and runs on, and the scope cuts then.
        """
        if self._held or not _COUNTS or not (cancelling := task.cancelling()):
            return False
        if cancelling - self._base <= _CUTS.get(task, 0) - self._cuts:
            return False  # none but sdkcore's own scopes' cuts since the scope opened
        self._held = True
        asyncio.get_running_loop().call_soon(then)
        return True

    def _send(self, task: Any) -> None:
        self._sent = True
        _CUTS[task] = _CUTS.get(task, 0) + 1
        task.cancel(_CUT)

    def _send_if_open(self) -> None:
        task = self._task
        if (
            self.open
            and task is not None
            and not self._sent
            and not self._hold(task, self._send_if_open)
        ):
            self._send(task)

    def _took_in(self, task: Any, pending: int, error: BaseException | None) -> bool:
        """Whether the code took in every cancellation pending from outside, all anyio
        scopes', and went on with this scope's cut alone (exit then reports the cut).

        Only when no other sdkcore cut is pending, ``error`` stands for the cut alone
        (:func:`_alone`), and what else is pending on the task is anyio's own count
        (:func:`_anyio_pending`): anyio takes those back at its scopes' exits, and knows
        its cancellation only by its message, so propagated as the caller's the scope's
        would escape them; a plain ``Task.cancel()`` among them is not asked twice and
        must propagate. Also when the caller's scope fired first and the cut came in its
        cleanup (held a turn): anyio's task group keeps a plain cancellation in place of
        its own, so only the scope's reaches here, and the request's deadline did pass.
        """
        if _CUTS.get(task, 0) != self._cuts or not _alone(error):
            return False
        # Counted from the scope's opening, as exit() counts: one a task took in and never
        # took back (no uncancel()) before the scope opened is neither (a review).
        return pending - self._base == _anyio_pending(task) - self._anyio

    def cancelled_elsewhere(self) -> bool:
        """Whether the task was asked to cancel since the scope opened, not by the scope
        (3.11+ counts it; 3.10 cannot tell: False). Read only when an error was raised
        while handling a cancellation, before :meth:`exit`."""
        task = self._task
        return _COUNTS and task is not None and task.cancelling() > self._base + self._sent

    def exit(self, error: BaseException | None) -> bool:
        """Close the scope after its code ended with ``error`` (None: it returned).

        True when the scope's own deadline or ``cancel()`` cut the code: ``error``
        is then the cancellation it caused (taken back here), an error the cut code
        raised in its place (e.g. grpc.aio's own cancellation), or None when the
        code swallowed the cancellation. False otherwise: ``error`` is the code's.
        """
        self.open = False  # the shared timer drops the entry when it reaches it
        queued = self._queued
        if queued is not None:
            self._queued = None
            queued.close()
        if not self.fired:
            self._task = None
            return False
        task = self._task
        self._task = None
        if not self._sent:
            # Fired from inside its own code and left before the cancellation was sent:
            # one that ended the code came from elsewhere (the caller's), never the scope's.
            return not isinstance(error, asyncio.CancelledError)
        _taken_back(task)
        # (3.10 cannot tell a concurrent outer cancellation: the scope is trusted.)
        if (
            _COUNTS
            and (pending := task.uncancel()) > self._base
            and not self._took_in(task, pending, error)
        ):
            # The task is being cancelled from outside as well (counted from the scope's
            # opening: a cancellation the task had swallowed before is not this one).
            return False
        return error is None or isinstance(error, (Exception, asyncio.CancelledError))


#: How soon a hedge runner whose caller is being cancelled looks again (Hedges.step).
_RECHECK = 0.001


class Hedges:
    """The copies of one hedged request, run as asyncio tasks (rfc/0004, "The runner").

    The caller's own task runs hedge 0 under a :class:`Scope` (the request's
    deadline), and one loop timer is armed for when the next hedge is due. Most
    requests end there: hedge 0 answers within the delay, the timer is cancelled,
    and the call made no task and no extra turn of the loop. When the timer fires,
    :meth:`step` starts the hedges due as plain tasks (``loop.create_task``) and
    re-arms the timer for the next one, or for the deadline. Every hedge task that
    ends runs :meth:`step` again (a done callback): once the chain is over, the
    losers are cancelled (``Task.cancel()``, and hedge 0's scope), and the caller,
    once hedge 0 has ended, waits on a future until every task has ended. A
    cancellation of the caller cuts every copy and is re-raised once all have ended:
    nothing outlives the call.
    """

    __slots__ = (
        "base",
        "caller",
        "chain",
        "deadline",
        "loop",
        "scope",
        "stopped",
        "tasks",
        "timer",
        "waiter",
    )

    def __init__(self, chain: HedgeChain, deadline: float) -> None:
        self.chain = chain
        self.deadline = deadline  # on the loop's clock (math.inf: none)
        self.loop = asyncio.get_running_loop()
        self.scope: Scope | None = None  # hedge 0's, while the caller runs it
        self.tasks: dict[asyncio.Task[None], Any] = {}  # hedges 1.. (and their attempts)
        self.timer: asyncio.TimerHandle | None = None  # the next hedge, or the deadline
        self.waiter: asyncio.Future[None] | None = None  # wakes the caller when all ended
        self.stopped = False  # no more hedges: the losers are being cut
        # The caller's task and its pending cancellations when the call began (3.11+; on
        # 3.10 None): one more means the caller is being cancelled (_caller_cancelled).
        # Read by run() from hedge 0's Scope, which reads both as it opens.
        self.caller: Any = None
        self.base = 0

    def cancel(self) -> None:
        """``Request.cancel()``: cut every copy in flight."""
        self.chain.cut = True
        self.step()

    async def run(self) -> None:
        chain = self.chain
        # Asked in the copies' tasks (an error raised for a cut); let go when the call
        # ends: kept, the chain and this runner would be a cycle only a collection frees.
        chain.cutting = self._cutting
        chain.callers_cut = self._callers_cut
        try:
            scope = self.scope = Scope(self.deadline)
            if _COUNTS:
                self.caller = scope._task
                self.base = scope._base
            attempt = chain.begin(0, chain.origin)
            when = chain.next_due()  # the hedging delay (math.inf: one copy only)
            if when < self.deadline:
                self.timer = self.loop.call_at(when, self.step)
            try:
                await chain.run(attempt)
            except BaseException as exc:
                self.scope = None
                if not scope.exit(exc):  # the caller is cancelled: cut every copy, then re-raise
                    await self._reap()
                    raise
                if not chain.over:  # the deadline (Request.cancel() set ``cut`` itself)
                    chain.cut = True
            else:
                self.scope = None
                scope.exit(None)
            if chain.over and not self.tasks:  # the common case: hedge 0 answered in time
                if self.timer is not None:
                    self.timer.cancel()
                return
            self.step()  # hedge 0 ended: what it changed (a non-fatal failure sends the next)
            try:
                while self.tasks or self.timer is not None:
                    waiter = self.waiter = self.loop.create_future()
                    await waiter
            except BaseException:  # the caller is cancelled: cut every copy, then re-raise
                await self._reap()
                raise
        finally:
            chain.cutting = chain.callers_cut = None

    def step(self) -> None:
        """Something changed (the timer fired, a hedge ended, a cut): act on it.

        Starts the hedges now due and re-arms the timer, or cuts every copy once the
        chain is over or cut, and wakes the caller when nothing is left to wait for.
        """
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        chain = self.chain
        if not self.stopped:
            if not chain.cut and self.loop.time() >= self.deadline and not chain.over:
                chain.cut = True
            if chain.cut:
                when = math.inf
            elif self._caller_cancelled():
                # The caller's task is being cancelled: its own cancellation unwinding hedge
                # 0 (whose send may take a while to clean up), or a timeout inside that send,
                # which takes its cancellation back. Nothing is sent now; the runner looks
                # again shortly. A real cancellation ends hedge 0, and run() then cuts every
                # copy (_reap). Until 2026-11-27 copies went on going out meanwhile.
                when = self.loop.time() + _RECHECK
            else:
                when = chain.send_due(self._start)
            if chain.over or chain.cut:
                self._stop()
            else:
                if when != math.inf or self.tasks or self.scope is not None:
                    when = min(when, self.deadline)  # a copy in flight or due: the deadline
                if when != math.inf:
                    self.timer = self.loop.call_at(when, self.step)
        waiter = self.waiter
        if (
            not self.tasks
            and self.timer is None
            and waiter is not None
            and not waiter.done()
            and self.scope is None
        ):
            waiter.set_result(None)

    def _cutting(self, index: int) -> bool:
        """Whether copy ``index`` is being cut now (``_Chain.cutting``): hedge 0 by its
        scope (the deadline, ``Request.cancel()``), not by the caller's own cancellation
        (what its send raises for that is the caller's, as with a bare await); a copy's
        task by any cancellation (3.11+: its pending ones; the runner alone cancels it)."""
        if index == 0:
            scope = self.scope
            return scope is not None and scope.fired
        task: Any = asyncio.current_task()
        return _COUNTS and task is not None and bool(task.cancelling() > 0)

    def _callers_cut(self, index: int) -> bool:
        """Whether the caller's own cancellation is reaching copy ``index`` in the caller's
        task (``_Chain.callers_cut``): hedge 0 while the caller is being cancelled."""
        return index == 0 and self._caller_cancelled()

    def _caller_cancelled(self) -> bool:
        """Whether the caller's task is being cancelled from outside (3.11+: more pending
        cancellations than when the call began; 3.10 cannot count them, so there a copy
        due while hedge 0 unwinds the caller's cancellation may still go out)."""
        task = self.caller
        if task is None:
            return False
        scope = self.scope
        if scope is not None and scope.fired:  # hedge 0's own cut counts one: not the caller's
            return False
        return bool(task.cancelling() > self.base)

    def _start(self, attempt: object) -> None:
        task = self.loop.create_task(self.chain.run(attempt))
        self.tasks[task] = attempt
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step never ran its copy: not sent after all.
        self.chain.unsent(self.tasks.pop(task))
        self.step()

    def _stop(self) -> None:
        """Send no more hedges and cancel every copy in flight."""
        self.stopped = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.scope is not None:
            self.scope.cancel()  # hedge 0, in the caller's task
        for task in self.tasks:
            task.cancel()

    async def _reap(self) -> None:
        """Cancel every hedge task and wait until all have ended (and booked their cut).

        Cancellations of the caller that arrive meanwhile are absorbed: the caller
        re-raises its own once this returns.
        """
        self._stop()
        while self.tasks:
            waiter = self.waiter = self.loop.create_future()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
