"""Answers lost when a server ends a bidirectional stream while the client writes.

The server answers one message and OK at once, without reading the client's only
message; the client writes that message at a varied moment (0-3 loop steps, maybe a nap
of up to 0.6 ms), so grpc.aio's write sometimes fails and it puts its stand-in status
(INTERNAL "Internal error from Core") on the call (sdkcore/grpc/_peer_status.py). For the
same seeded timings, three readers of the same server on 127.0.0.1:

* grpc.aio's own ``async for`` on a plain channel;
* grpc.aio's ``read()`` loop on a plain channel;
* ``async for`` on an sdkcore channel (``insecure_channel(..., throttle=...)``).

Prints, per reader, the calls answered, the calls lost (an INTERNAL raised before the
answer), and the calls that met the race (grpc.aio logged a failed write).
Run: ``uv run --extra grpc python bench/bench_write_race.py --calls 1500``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "grpc_a6"))

from grpc import aio
from grpc_server import Server

from sdkcore import AdaptiveThrottle
from sdkcore.grpc import insecure_channel

READERS = ("grpc.aio async for", "grpc.aio read()", "sdkcore async for")


class FailedWrites(logging.Handler):
    """Counts grpc.aio's debug lines for a write that failed (each call that met the race)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if 'Failed "execute_batch"' in record.getMessage():
            self.count += 1


async def run(calls: int) -> Counter[tuple[str, str]]:
    server = Server()

    async def answer(requests: Any, context: Any, n: int) -> Any:
        yield b"ok"

    name = server.stream_stream("M", answer)
    await server.start()
    outcomes: Counter[tuple[str, str]] = Counter()
    writes = FailedWrites()
    grpc_log = logging.getLogger("grpc.aio._call")
    grpc_log.setLevel(logging.DEBUG)
    grpc_log.addHandler(writes)
    try:
        for reader in READERS:
            writes.count = 0
            rng = random.Random(5)  # the same timings for every reader
            channel = (
                insecure_channel(server.target, throttle=AdaptiveThrottle(name="bench"))
                if reader.startswith("sdkcore")
                else aio.insecure_channel(server.target)
            )
            async with channel:
                method = channel.stream_stream(name)
                for _ in range(calls):
                    spins = rng.randrange(4)
                    nap = rng.random() * 0.0006 if rng.random() < 0.5 else 0.0

                    async def requests(spins: int = spins, nap: float = nap) -> Any:
                        for _ in range(spins):
                            await asyncio.sleep(0)
                        if nap:
                            await asyncio.sleep(nap)
                        yield b"q"

                    call = method(requests())
                    try:
                        if reader.endswith("read()"):
                            got = []
                            while (message := await call.read()) is not aio.EOF:
                                got.append(message)
                        else:
                            got = [message async for message in call]
                        outcomes[(reader, "answered" if got == [b"ok"] else "other")] += 1
                    except aio.AioRpcError as err:
                        outcomes[(reader, f"lost ({err.code().name})")] += 1
            outcomes[(reader, "calls that met the race")] = writes.count
    finally:
        grpc_log.removeHandler(writes)
        await server.stop()
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1500)
    args = parser.parse_args()
    outcomes = asyncio.run(run(args.calls))
    for reader in READERS:
        row = {k: v for (r, k), v in sorted(outcomes.items()) if r == reader}
        print(f"{reader:20s} {row}")


if __name__ == "__main__":
    main()
