"""The runtime layer: the only place that waits (rfc/0001, "The runtime layer").

One small module per event loop, as anyio's ``_backends`` has, each with the same
two waiting operations:

* ``sleep(seconds)``: a backoff wait (an injected sleep replaces it in tests);
  ``sleep(0)`` is the checkpoint, one turn of the loop (a zero backoff): asyncio and
  trio both take it as exactly that, so it needs no function of its own;
* ``Scope(deadline)``: a deadline scope around an attempt, a backoff or a whole
  ``execute``: armed at ``deadline`` (the loop's clock, ``math.inf`` for none),
  cancelled early by ``Scope.cancel()`` (``Request.cancel()``), and ``exit(error)``
  tells whether the scope itself cut what ran inside it (``fired`` before it), and
  ``cancelled_elsewhere()`` whether the task is being cancelled by someone else;

plus ``now()``, the loop's clock that deadlines are armed on (trio's module also has
``scope_left()``, the enclosing scopes' deadline: ``sdkcore._request._scope_left``
says why asyncio's half is not here), and ``Hedges(chain,
deadline)``, which runs the copies of one hedged request as the loop's own tasks
(rfc/0004, "The runner"): the chain (:class:`HedgeChain`, in ``sdkcore._hedge``)
decides what is sent when; ``Hedges`` only starts, wakes and cuts.

Each backend module imports only its own event loop library, which a running
program has already imported: choosing one costs no heavy import on a request's
clock (one small module, once per process). :func:`current` finds the running
loop's module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

__all__ = ["HedgeChain", "current"]


class HedgeChain(Protocol):
    """What ``Hedges`` needs from a hedged request's chain (``sdkcore._hedge._Chain``)."""

    origin: float  # when the chain started, on the loop's clock
    outstanding: int  # copies sent and not ended
    cut: bool  # set by ``Hedges``: the deadline or ``Request.cancel()`` cut the chain
    wake: Callable[[], None] | None  # called by every copy that ends
    #: Set by ``Hedges``: whether copy ``index`` is being cut now (asked in the copy's task
    #: when its send raises: an error raised for its cut is how it ended being cut).
    cutting: Callable[[int], bool] | None
    #: Set by asyncio's ``Hedges``: whether the caller's own cancellation is reaching copy
    #: ``index`` in the caller's task (hedge 0).
    callers_cut: Callable[[int], bool] | None

    @property
    def over(self) -> bool:
        """A copy won or a failure ended the chain: the others are to be cut."""

    def next_due(self) -> float:
        """When the next copy is due (``math.inf``: none will be sent)."""

    def send_due(self, start: Callable[[Any], object]) -> float:
        """Book every copy due now and hand it to ``start``; then :meth:`next_due`."""

    def begin(self, index: int, now: float) -> Any:
        """Book copy ``index`` as sent at ``now``."""

    async def run(self, attempt: Any) -> None:
        """Send one booked copy and book its outcome (raises only its cancellation)."""

    def unsent(self, attempt: Any) -> None:
        """A booked copy whose :meth:`run` never began: book it as not sent (else no-op)."""

    def skip(self, attempt: Any) -> None:
        """A booked copy whose task began but will not send: not sent, the runner woken."""


_asyncio_backend: ModuleType | None = None
_trio_backend: ModuleType | None = None


def current() -> ModuleType:
    """The backend module of the event loop running this task (asyncio or trio).

    Trio marks its threads in ``sniffio.thread_local`` (sniffio is one of trio's own
    dependencies): one attribute read, against 0.4 us for asking trio on asyncio.
    """
    sniffio = sys.modules.get("sniffio")
    if sniffio is not None and sniffio.thread_local.name == "trio":
        return _trio_backend or _load_trio()
    return _asyncio_backend or _load_asyncio()


# Each backend is imported by the first call on its loop: the loop's library is loaded
# by then (it runs this task), so this costs one small module once per process, and
# ``import sdkcore`` imports neither asyncio nor trio.
def _load_asyncio() -> ModuleType:
    global _asyncio_backend
    from . import _asyncio as backend

    _asyncio_backend = backend
    return backend


def _load_trio() -> ModuleType:
    global _trio_backend
    from . import _trio as backend

    _trio_backend = backend
    return backend
