"""A request's retry state and its transitions (RFC 0049 "Request Annotation", the retry half).

:class:`RetryState` is the base class of :class:`sdkcore.Request`: what happened to
the request's attempts (retries, reasons, failures, completion), read through
properties and changed only through the transition methods below, which the doors
and the hedging runner call (rfc/0001, "Who changes a request"). ``_request.py``
keeps what the application sets (timeout, idempotency, strategy, context) and the
deadline; the two halves share one object, so a transition is one method call on
the request, as before the split.
"""

from __future__ import annotations

import enum
import sys
import threading
from datetime import timedelta
from typing import Any

from ._context import AttemptEffect, AttemptRecord, CancellationReason, describe_error
from ._reason import RetryReason

__all__ = ["RequestState", "RetryState"]

_NOT_SENT = AttemptEffect.NOT_SENT
_MAYBE = AttemptEffect.MAYBE_APPLIED


class RequestState(enum.Enum):
    """Where a :class:`Request` is (``Request.state``): PENDING until it completes, then
    SUCCEEDED, FAILED (an error answered it, or a refusal) or CANCELLED (its timeout,
    ``Request.cancel()`` or the caller's own cancellation: ``Request.cancellation_reason``
    says which). A completed request is never sent again."""

    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


_PENDING = RequestState.PENDING

#: Held while the ending of a request ``execute_sync`` runs is checked and set, and by every
#: ``Request.cancel()``. That door's caller may cancel from another thread, and a check and
#: a set apart let one ending overwrite the other: the cancelled request ended FAILED and
#: its caller got the answer's error (Python 3.10 switches threads between the two:
#: test_sync_fuzz.py, seed 44; tests/test_request_ending_race.py splits them on purpose).
#: The async doors end a request on the loop's thread, where ``cancel()`` is called too,
#: so they skip the lock: it cost 161 ns a successful call against 14 ns for the check of
#: ``_threaded`` (timeit, median of 7 interleaved rounds, one-off; bench/README, "The
#: ending's lock").
_ENDING = threading.Lock()


def _let_chain_go(error: BaseException) -> None:
    """Free the frames held by the tracebacks of the exceptions ``error`` was raised while
    handling (its ``__context__`` chain; its own is freed by the caller): a ``send`` that
    raises ``RetryableError`` in an ``except`` block keeps the transport error it handled,
    whose traceback holds ``send``'s frame, whose ``request`` holds this failure (a
    reference cycle per retried request else). Types and messages stay.

    Only the implicit chain: an explicit ``__cause__`` (``raise ... from conn.broken``) may
    be an exception the request does not own, kept by a connection or by another request's
    caller, whose traceback is theirs. Nor the exceptions the caller is handling (a door
    called in an ``except`` block chains them too)."""
    handled: set[int] = set()
    current = sys.exc_info()[1]
    while current is not None and len(handled) < 100:  # (bounded: a chain built in a loop)
        handled.add(id(current))
        current = current.__context__
    link = error.__context__
    for _ in range(100):
        if link is None or id(link) in handled:
            return
        link.__traceback__ = None
        link = link.__context__


class RetryState:
    """The retry half of a :class:`sdkcore.Request` (see the module's docstring)."""

    __slots__ = (
        "_cancellation",
        "_counted",
        "_dispatched",
        "_history",
        "_in_block",
        "_in_flight",
        "_last_error",
        "_last_reason",
        "_maybe_applied",
        "_paid",
        "_reasons",
        "_retries",
        "_sending",
        "_sent",
        "_sent_at",
        "_state",
        "_threaded",
    )

    def __init__(self) -> None:
        self._retries = 0
        self._reasons: list[RetryReason] = []  # distinct, first-seen order (a list: 100 B less)
        self._state = _PENDING
        self._cancellation: CancellationReason | None = None
        self._sent = False
        self._in_flight = False
        self._last_reason: RetryReason | None = None
        # One entry per failed attempt: [reason, effect, error, duration s, delay s].
        self._history: list[list[Any]] = []
        self._last_error: BaseException | None = None
        self._maybe_applied = False
        self._sent_at = -1.0  # clock time the attempt in flight was sent (-1: none)
        self._dispatched = False  # a door has counted its first attempt
        self._threaded = False  # run by execute_sync: its endings hold _ENDING
        self._sending = False  # a door is sending it (execute, execute_sync, hedge)
        self._in_block = False  # an attempt() block is open on it (a hand-wired loop)
        self._paid: Any = None  # the retry budget that paid for the attempt being sent
        self._counted = False  # execute_sync counted it in _in_retry_sync (under the lock)

    # -- read-only retry state -------------------------------------------------
    @property
    def retry_attempts(self) -> int:
        """How many retries have happened (0 before the first retry)."""
        return self._retries

    @property
    def retry_reasons(self) -> tuple[RetryReason, ...]:
        """Every distinct reason this request was retried for, in first-seen order."""
        return tuple(self._reasons)

    @property
    def state(self) -> RequestState:
        return self._state

    @property
    def completed(self) -> bool:
        """True once the request succeeded, failed or was cancelled."""
        return self._state is not _PENDING

    @property
    def cancelled(self) -> bool:
        return self._state is RequestState.CANCELLED

    @property
    def cancellation_reason(self) -> CancellationReason | None:
        return self._cancellation

    @property
    def reached_network(self) -> bool:
        """True if some attempt may have been written to the network.

        Set when an attempt is cut off in flight, when a failed attempt was recorded
        whose effect is not ``AttemptEffect.NOT_SENT``, or when the request succeeded.
        """
        return self._sent

    @property
    def maybe_applied(self) -> bool:
        """True if some attempt may have been applied on the server.

        A timeout of a non-idempotent request is ambiguous exactly when this is true
        (see rfc/0001, "Ambiguity").
        """
        return self._maybe_applied

    @property
    def last_reason(self) -> RetryReason | None:
        """The reason of the last attempt that failed with one (None before any)."""
        return self._last_reason

    @property
    def last_effect(self) -> AttemptEffect | None:
        """What is known about the server side of the last failed attempt (None before any)."""
        history = self._history
        return history[-1][1] if history else None

    @property
    def in_flight(self) -> bool:
        """True while an attempt is being sent (between its start and its outcome)."""
        return self._in_flight

    @property
    def failed_attempts(self) -> int:
        """How many attempts failed (or were cut in flight) so far: ``len(attempts)``."""
        return len(self._history)

    @property
    def attempts(self) -> tuple[AttemptRecord, ...]:
        """Every failed attempt so far, oldest first (see :class:`AttemptRecord`)."""
        return tuple(
            AttemptRecord(
                number=n,
                reason=reason,
                effect=effect,
                error=describe_error(error),
                duration=None if duration is None else timedelta(seconds=duration),
                delay=None if delay is None else timedelta(seconds=delay),
            )
            for n, (reason, effect, error, duration, delay) in enumerate(self._history, 1)
        )

    @property
    def last_error(self) -> BaseException | None:
        """The last attempt's failure (its cause when it was a ``RetryableError``)."""
        return self._last_error

    # -- transitions (called by the doors and the hedging runner only) ------------
    # A request's retry state changes only through these methods: every other module
    # reads it through the properties above (rfc/0001, "Who changes a request").
    def _begin_attempt(self, now: float) -> None:
        """An attempt is being sent at ``now`` (the request's clock)."""
        self._in_flight = True
        self._sent_at = now

    def _begin_attempt_on_threads(self, now: float) -> bool:
        """:meth:`_begin_attempt` for ``execute_sync``, only while the request is pending
        (False: nothing may be sent). The attempt is marked in flight first, then the state
        read: ``Request.cancel()`` from another thread sets the state (under ``_ENDING``)
        either before that read, and nothing is sent, or after the mark, and the attempt
        is in flight: no attempt begins after a cancel returned, though one marked a few
        steps before its ``send`` runs may still go out (reported as maybe applied;
        rfc/0001). No lock: under
        the GIL the two threads' steps interleave whole, and taking ``_ENDING`` here cost
        0.15 us more of a 2.6 us successful call (bench/README, "The sync door's cancel check")."""
        self._in_flight = True
        self._sent_at = now
        if self._state is _PENDING:
            return True
        self._in_flight = False
        self._sent_at = -1.0
        return False

    def _first_dispatch(self) -> bool:
        """True the first time a door asks: the request's first attempt goes out."""
        if self._dispatched:
            return False
        self._dispatched = True
        return True

    def _attempt_failed(
        self,
        reason: RetryReason | None,
        effect: AttemptEffect,
        error: BaseException | None,
        now: float,
        started: float | None = None,
    ) -> None:
        """Book the attempt in flight (or the last one sent) as failed at ``now``.

        ``reason`` None: it failed otherwise (a final answer) or was cut in flight.
        Its backoff is booked by :meth:`_retry_booked` when it is retried.
        ``started``: when it was sent, on the same clock as ``now`` (a hedge's own
        start; default: the one :meth:`_begin_attempt` booked).
        """
        if started is None:
            started = self._sent_at
        paid = self._paid
        if paid is not None:  # the attempt a budget paid for: booked now
            self._paid = None
            if effect is _NOT_SENT:  # it added no load (an OPEN breaker's refusal): given back
                paid.refund()
        self._history.append(
            [reason, effect, error, None if started < 0.0 else now - started, None]
        )
        self._in_flight = False
        self._sent_at = -1.0
        if error is not None:
            previous = self._last_error
            if previous is not None and previous is not error:
                # Only the last failure keeps its traceback (the final exception's
                # __cause__): the frames of older ones are freed at once, so a request
                # waiting in backoff holds one failed attempt's frames, not every one.
                # The chain's only when there is one: a call per failure was 1.7% of a
                # retried execute's instructions (bench/README, "eleventh session").
                previous.__traceback__ = None
                if previous.__context__ is not None:
                    _let_chain_go(previous)
            self._last_error = error
        if reason is not None:
            self._last_reason = reason
        if effect is not _NOT_SENT:
            self._sent = True
            if effect is _MAYBE:
                self._maybe_applied = True

    def _retry_booked(self, reason: RetryReason, delay: float | None) -> None:
        """The failed attempt is retried for ``reason`` after ``delay`` seconds."""
        self._retries += 1
        if reason not in self._reasons:
            self._reasons.append(reason)
        history = self._history
        if history:
            history[-1][4] = delay

    def _has_unsent_retry(self) -> bool:
        """A retry was booked (:meth:`_retry_booked`) and no attempt has begun since."""
        history = self._history
        return not self._in_flight and bool(history) and history[-1][4] is not None

    def _hedge_sent(self) -> None:
        """One more copy of a hedged request went out (a retry, by the RFC's count)."""
        self._retries += 1

    def _reason_seen(self, reason: RetryReason) -> None:
        """A hedge failed for ``reason``: listed in ``retry_reasons``."""
        if reason not in self._reasons:
            self._reasons.append(reason)

    def _succeeded(self) -> bool:
        """The request got its answer; False when it had completed already (e.g.
        ``Request.cancel()`` from another thread came first).

        The last failure lets go of its traceback (:meth:`_attempt_failed` freed the
        older ones): a traceback holds the frames it passed through, and those hold
        the request, whose history holds the failure: a reference cycle per retried
        call (about 1 us per retry in bench/bench_core.py). Types and messages stay
        for :attr:`attempts`.
        """
        if self._threaded:
            completed = self._end_locked(RequestState.SUCCEEDED, None)
        else:  # written out: the call to _end is a quarter of this method's cost
            completed = self._state is _PENDING
            if completed:
                self._state = RequestState.SUCCEEDED
        self._paid = None  # the attempt it paid for answered: spent
        if completed:  # the answer ends the attempt in flight (it was sent: it answered)
            self._in_flight = False
            self._sent_at = -1.0
            self._sent = True
        error = self._last_error
        if error is not None:
            error.__traceback__ = None
            if error.__context__ is not None:
                _let_chain_go(error)
        return completed

    def _finish(self, state: RequestState, why: CancellationReason | None = None) -> bool:
        """Complete the request (once: a completed request keeps its first ending).

        True when this call completed it, False when it had completed already.
        """
        if self._threaded:
            return self._end_locked(state, why)
        return self._end(state, why)

    def _end_locked(self, state: RequestState, why: CancellationReason | None) -> bool:
        """:meth:`_end` under ``_ENDING`` (``Request.cancel()``, and the endings of a request
        ``execute_sync`` runs)."""
        # ``with``, not acquire() then try: an interrupt (KeyboardInterrupt) raised between
        # the two left the lock held, and every later ending on every thread blocked.
        with _ENDING:
            return self._end(state, why)

    def _end(self, state: RequestState, why: CancellationReason | None) -> bool:
        """The check and the set of an ending (see ``_ENDING``: hold it when threads may race)."""
        if self._state is not _PENDING:
            return False
        self._state = state
        self._cancellation = why
        return True

    def _finish_by(self, exc: BaseException) -> None:
        """The call ended with ``exc``: FAILED for an error, CANCELLED (TASK_CANCELLED) else."""
        if isinstance(exc, Exception):
            self._finish(RequestState.FAILED)
        else:
            self._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)

    def _time_out(self) -> None:
        """Complete the request as timed out (CANCELLED, TIMEOUT), whatever a cut left
        behind (e.g. marked cancelled by the task), unless ``Request.cancel()`` ended it."""
        if not self._threaded:
            self._end_timed_out()
            return
        with _ENDING:
            self._end_timed_out()

    def _end_timed_out(self) -> None:
        if self._cancellation is not CancellationReason.CANCELLED_VIA_CONTEXT:
            self._state = RequestState.CANCELLED
            self._cancellation = CancellationReason.TIMEOUT

    def _being_sent(self) -> bool:
        """Whether a door is sending this request now: ``execute``, ``execute_sync`` or
        ``hedge`` running it (``_sending``), or a hand-wired loop with an attempt in flight
        or behind it. A request is one operation: a second door would send it again."""
        return self._sending or self._in_flight or bool(self._history)

    def _claim_on_threads(self) -> bool:
        """``execute_sync``'s start: mark the request as being sent and run on threads
        (``Request.cancel()`` may come from another one), unless a door is sending it
        already (False). Under ``_ENDING``: two threads handed one request cannot both
        take it."""
        with _ENDING:
            if self._being_sent():
                return False
            self._sending = True
            self._on_threads()
            return True

    def _on_threads(self) -> None:
        """``execute_sync`` runs the request: ``Request.cancel()`` may come from another
        thread, so its endings hold ``_ENDING`` from now on."""
        self._threaded = True
