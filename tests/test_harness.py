"""The harness's own helpers (tests/conftest.py, stderr_kit.py): they do what they say."""

from __future__ import annotations

import gc
import time

import pytest


def test_gc_pauses_records_each_collection(gc_pauses: list[tuple[float, float]]) -> None:
    before = time.monotonic()
    gc.collect()
    after = time.monotonic()
    assert gc_pauses, "a collection ran and was not recorded"
    start, end = gc_pauses[-1]
    assert before <= start <= end <= after


@pytest.mark.usefixtures("no_gc_pauses")
def test_no_gc_pauses_turns_collections_off_for_the_test() -> None:
    assert not gc.isenabled()


def test_collections_are_back_on_after_it() -> None:
    assert gc.isenabled()


def test_stderr_kit_forgives_only_grpcs_own_cancellation_noise() -> None:
    from stderr_kit import tracebacks

    noise = (
        "sdkcore demo: serving metrics at http://127.0.0.1:9/metrics\n"
        "Traceback (most recent call last):\n"
        '  File "src/python/grpcio/grpc/_cython/_cygrpc/aio/server.pyx.pxi", line 812, '
        "in grpc._cython.cygrpc._schedule_rpc_coro\n"
        "asyncio.exceptions.CancelledError\n"
    )
    ours = (
        "Traceback (most recent call last):\n"
        '  File "/x/sdkcore/_demo/__init__.py", line 3, in main\n'
        "    run()\n"
        "KeyboardInterrupt\n"
    )
    assert not tracebacks(noise)
    assert not tracebacks(noise.encode())
    assert tracebacks(ours)
    assert tracebacks(noise + ours)
