"""The harness's own fixtures for collections (tests/conftest.py): they do what they say."""

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
