"""A real byte stream whose ``send`` lingers once the frame is written.

The checkpoint after a write (the transport draining): where a cancellation lands
after the frame went out. Shared by the write-cut tests of the example client.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc


class LingeringSend(anyio.abc.ByteStream):
    """``inner``, with ``send`` sleeping ``linger`` seconds after the frame is written."""

    def __init__(self, inner: anyio.abc.ByteStream, linger: float) -> None:
        self.inner = inner
        self.written = anyio.Event()
        self.linger = linger

    async def send(self, item: bytes) -> None:
        await self.inner.send(item)
        self.written.set()
        await anyio.sleep(self.linger)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self.inner.receive(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def extra_attributes(self) -> Any:
        return self.inner.extra_attributes
