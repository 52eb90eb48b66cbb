"""Client-streaming throughput: an sdkcore channel (retryPolicy) against plain grpc.aio.

One call sends ``--messages`` 16-byte request messages to a loopback server that counts
them; the two channels take turns (plain first on even rounds, sdkcore first on odd ones)
and the figure is the median of ``--rounds`` per-message times of each, and their ratio.
It checks that the replay buffer's bounded read of the request iterator (at most
``_replay.READ_AHEAD`` messages ahead of the wire) costs no throughput.

    uv run python bench/bench_stream.py [--messages 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "grpc_a6"))

from grpc import aio
from grpc_server import Server, retry_config

from sdkcore.grpc import insecure_channel


async def main(messages: int, rounds: int) -> None:
    server = Server()

    async def count(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        n = 0
        async for _ in requests:
            n += 1
        return b"%d" % n

    method = server.stream_unary("Count", count)
    await server.start()
    try:
        plain = aio.insecure_channel(server.target)
        ours = insecure_channel(server.target, service_config=retry_config())

        def requests() -> Iterator[bytes]:
            for _ in range(messages):
                yield b"x" * 16

        times: dict[str, list[float]] = {"plain": [], "sdkcore": []}
        for r in range(rounds):
            order = [("plain", plain), ("sdkcore", ours)]
            for name, channel in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                answer = await channel.stream_unary(method)(requests())
                assert answer == b"%d" % messages, answer
                times[name].append((time.perf_counter() - t0) / messages)
        p, q = statistics.median(times["plain"]), statistics.median(times["sdkcore"])
        print(f"{messages} messages a call, median of {rounds} rounds")
        print(f"  plain grpc.aio   {p * 1e6:7.1f} us a message")
        print(f"  sdkcore channel  {q * 1e6:7.1f} us a message   {q / p:.2f}x plain")
        await plain.close()
        await ours.close()
    finally:
        await server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.rounds))
