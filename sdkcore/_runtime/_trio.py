"""The trio backend: trio's own cancel scope and clock."""

from __future__ import annotations

import trio

__all__ = ["Scope", "checkpoint", "now", "sleep"]

sleep = trio.sleep
checkpoint = trio.lowlevel.checkpoint
now = trio.current_time


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

    def cancel(self) -> None:
        if self.open:
            self._scope.cancel()

    def exit(self, error: BaseException | None) -> bool:
        """See the asyncio backend: True when this scope cut the code."""
        self.open = False
        scope = self._scope
        if error is None:
            scope.__exit__(None, None, None)
        elif scope.__exit__(type(error), error, error.__traceback__):
            return True  # our own trio.Cancelled, swallowed by the scope
        if not scope.cancel_called:
            return False
        # Cut while the code swallowed the cancellation, or raised its own error for it.
        return error is None or isinstance(error, Exception)
