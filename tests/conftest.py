"""Shared fixtures: every core async test runs on asyncio and trio (anyio's plugin)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def no_gc_pauses() -> Iterator[None]:
    """No garbage collection during the test (collections resume after it).

    For tests whose real sleeps race each other, or that bound a command's duration by
    its deadline: in a full run's heap one collection paused the whole process for up
    to 0.28 s (measured once, in a review) at a moment no test chooses (timers came due
    together, in any order, and a hang detector saw a slow command). Cycles the test
    makes wait for the next one.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.fixture
def gc_pauses() -> Iterator[list[tuple[float, float]]]:
    """``(start, end)`` on ``time.monotonic()`` of each collection during the test.

    For checks that bound how long something took by a deadline: a collection pauses
    the whole process (up to 0.28 s in a full run's heap), which no deadline can help;
    such a check leaves these spans out, as it leaves out the pauses it makes itself.
    """
    spans: list[tuple[float, float]] = []
    began = [0.0]

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.monotonic()
        else:
            spans.append((began[0], time.monotonic()))

    gc.callbacks.append(note)
    try:
        yield spans
    finally:
        gc.callbacks.remove(note)
