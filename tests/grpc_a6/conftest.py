"""Fixture: a real grpc.aio server on 127.0.0.1 (port 0), stopped after each test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("grpc")
import pytest_asyncio
from grpc_server import TEST_TIMEOUT, Server


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Server]:
    s = Server()
    await asyncio.wait_for(s.start(), TEST_TIMEOUT)
    try:
        yield s
    finally:
        await asyncio.wait_for(s.stop(), TEST_TIMEOUT)
