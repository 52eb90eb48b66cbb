"""A request's ending is checked and set as one step, whatever thread ends it.

``Request.cancel()`` may come from another thread than the door that ends the request
(``execute_sync``'s caller cancels from elsewhere). If a door's check ("still pending?")
and its set ("failed") could be split by the other thread's ending, one ending would
overwrite the other: the cancelled request would end FAILED and its caller would get the
answer's error instead of RequestCanceledException. Python 3.10 switches threads between
the two (test_sync_fuzz.py, seed 44, about one run in 40); 3.11+ happened not to there.

These tests make the split happen on every Python: a line tracer stops the ending thread
right before its set and lets the other thread end the request then (joined for at most
``WAIT`` s: with the ending's lock held, it waits until the first ending is done).
"""

from __future__ import annotations

import linecache
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

from sdkcore import CancellationReason, Request, RequestState

#: How long the interleaved ending may take before the first one goes on (seconds).
WAIT = 0.2

_VIA_CONTEXT = CancellationReason.CANCELLED_VIA_CONTEXT


@contextmanager
def interleaved(method: str, line: str, other: Callable[[], Any]) -> Iterator[list[Any]]:
    """While the body runs, the first time ``method`` reaches the source line ``line``,
    ``other()`` runs in another thread first. Yields ``[other's result]`` (filled in once
    that thread ended, after the body)."""
    result: list[Any] = []
    fired = threading.Event()
    thread = threading.Thread(target=lambda: result.append(other()))

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if (
            event == "line"
            and not fired.is_set()
            and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() == line
        ):
            fired.set()
            thread.start()
            thread.join(WAIT)
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if event == "call" and frame.f_code.co_name == method else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield result
    finally:
        sys.settrace(previous)
        if fired.is_set():
            thread.join()
    assert fired.is_set(), f"{method} never reached {line!r}: the test no longer splits it"


def _cancel(request: Request) -> Callable[[], tuple[Any, Any]]:
    """``Request.cancel()`` in the other thread; what the request says right after it."""

    def cancel() -> tuple[Any, Any]:
        request.cancel()
        return request.state, request.cancellation_reason

    return cancel


def _run_by_a_thread_door() -> Request:
    request = Request()
    request._on_threads()  # as execute_sync marks the requests it runs
    return request


@pytest.mark.parametrize(
    ("ending", "state"),
    [
        (lambda r: r._finish(RequestState.FAILED), RequestState.FAILED),
        (lambda r: r._succeeded(), RequestState.SUCCEEDED),
    ],
    ids=["failed", "succeeded"],
)
def test_a_cancel_between_the_check_and_the_set_never_overwrites_or_is_overwritten(
    ending: Callable[[Request], bool], state: RequestState
) -> None:
    request = _run_by_a_thread_door()
    with interleaved("_end", "self._state = state", _cancel(request)) as other:
        ended = ending(request)
    (seen_by_cancel,) = other
    final = (request.state, request.cancellation_reason)
    # Whoever ended the request first, its ending is the one both sides see, and the door
    # knows whether it was its own.
    assert final == seen_by_cancel, f"the ending changed: {seen_by_cancel} then {final}"
    assert final == ((state, None) if ended else (RequestState.CANCELLED, _VIA_CONTEXT))


def test_a_cancel_during_a_time_out_is_kept_or_refused_never_lost() -> None:
    """A timeout ends the request whatever a cut left behind, except Request.cancel()'s
    ending: the ending cancel() saw is still the request's ending afterwards."""
    request = _run_by_a_thread_door()
    with interleaved(
        "_end_timed_out", "self._state = RequestState.CANCELLED", _cancel(request)
    ) as other:
        request._time_out()
    (seen_by_cancel,) = other
    final = (request.state, request.cancellation_reason)
    assert final == seen_by_cancel, f"the ending changed: {seen_by_cancel} then {final}"
    assert request.state is RequestState.CANCELLED


class _CountingLock:
    """Stands in for ``_ENDING``: counts the acquisitions."""

    def __init__(self) -> None:
        self.acquired = 0

    def acquire(self) -> bool:
        self.acquired += 1
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.mark.parametrize("threaded", [False, True], ids=["async-door", "execute_sync"])
def test_only_a_thread_doors_request_takes_the_lock_to_end(
    threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async doors end a request on the loop's thread, where cancel() runs too: their
    endings skip the lock (its cost: bench/README, "The ending's lock"); cancel() and the
    endings of a request execute_sync runs take it."""
    from sdkcore import _retry_state

    lock = _CountingLock()
    monkeypatch.setattr(_retry_state, "_ENDING", lock)
    ended, failed, timed_out = Request(), Request(), Request()
    if threaded:
        for request in (ended, failed, timed_out):
            request._on_threads()
    assert ended._succeeded() is True
    assert failed._finish(RequestState.FAILED) is True
    timed_out._time_out()
    assert lock.acquired == (3 if threaded else 0)
    Request().cancel()
    assert lock.acquired == (4 if threaded else 1)
