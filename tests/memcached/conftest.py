"""Fixtures: real memcached processes and a fault proxy in front of them.

Without memcached installed these tests skip (locally) or fail (under CI=true);
``.ci/run`` installs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached, memcached_binary


@pytest.fixture
def start_memcached() -> Iterator[Callable[..., Memcached]]:
    """Start memcached processes (extra command-line args); all are killed at teardown."""
    binary = memcached_binary()
    started: list[Memcached] = []

    def start(*args: str) -> Memcached:
        server = Memcached(binary, *args)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.kill()


@pytest.fixture
def memcached(start_memcached: Callable[..., Memcached]) -> Memcached:
    return start_memcached()


@pytest.fixture
def proxy(memcached: Memcached) -> Iterator[FaultProxy]:
    """A fault proxy in front of ``memcached``."""
    fault = FaultProxy(memcached.port).start()
    try:
        yield fault
    finally:
        fault.stop()
