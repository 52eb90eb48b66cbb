"""A caller cancelled while its frame is being written never costs the connection.

A hedge's losing copy is cancelled at any point of its dispatch, also between the
moment its frame reached the transport and the end of ``send`` (anyio's checkpoint
after the write). The client used to close the connection there, taking it for a
frame cut in half, and every other request in flight on it failed
(bench/bench_hedge_adaptive.py saw one drop per lost race). The frame is whole:
the connection must stay, and the other requests on it must be answered.
"""

from __future__ import annotations

import asyncio

import anyio
import anyio.abc
import pytest
from lingering_stream import LingeringSend
from memcached_server import Memcached

from sdkcore.examples.memcached import _protocol as proto
from sdkcore.examples.memcached._client import _Connection

pytestmark = pytest.mark.anyio


async def connected(memcached: Memcached) -> tuple[_Connection, LingeringSend]:
    stream = LingeringSend(await anyio.connect_tcp("127.0.0.1", memcached.port), linger=0.05)
    return _Connection(stream, f"127.0.0.1:{memcached.port}"), stream


async def get(connection: _Connection, opaque: int) -> proto.Response:
    return await connection.roundtrip(proto.get_frame(opaque, "k"), opaque, lambda: False)


async def test_a_scope_cancelled_mid_write_leaves_the_frame_whole(memcached: Memcached) -> None:
    connection, stream = await connected(memcached)
    async with anyio.create_task_group() as tg:
        tg.start_soon(connection.read_loop)
        with anyio.CancelScope() as loser:

            async def cancel_once_written() -> None:
                await stream.written.wait()
                loser.cancel()  # the hedge won: cut the losing copy in the middle of send

            tg.start_soon(cancel_once_written)
            await get(connection, 1)
        assert loser.cancelled_caught
        stream.linger = 0.0
        answer = await get(connection, 2)  # the next request on the same connection
        assert answer.opaque == 2
        assert connection.lost is None
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_task_cancelled_after_its_write_keeps_the_others_answered(
    memcached: Memcached,
) -> None:
    # sdkcore's asyncio runtime cuts a losing copy with Task.cancel(): no scope to shield
    connection, stream = await connected(memcached)
    async with anyio.create_task_group() as tg:
        tg.start_soon(connection.read_loop)
        loser = asyncio.ensure_future(get(connection, 1))
        await stream.written.wait()
        stream.linger = 0.0
        other = asyncio.ensure_future(get(connection, 2))  # in flight beside it
        loser.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loser
        assert (await other).opaque == 2
        assert connection.lost is None
        tg.cancel_scope.cancel()
