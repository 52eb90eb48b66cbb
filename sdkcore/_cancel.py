"""Telling our own cancellations from the caller's (shared by execute and hedge)."""

from __future__ import annotations

__all__ = ["outer_cancel_pending"]


def outer_cancel_pending() -> bool:
    """After our cancel scope let a cancellation through: is the task itself being cancelled?

    On asyncio 3.11+ anyio has removed its own cancellation requests by then, so a
    positive ``Task.cancelling()`` means someone else cancelled the task. Trio's own
    scope catches its own cancellations, so one it let through is never ours. Python
    3.10 cannot tell: the deadline is trusted.
    """
    try:
        import asyncio

        task = asyncio.current_task()
    except RuntimeError:  # not on asyncio
        return True
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling is not None and cancelling())
