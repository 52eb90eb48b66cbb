"""The first hedge of a process: what it imports and how long it takes, on asyncio and trio.

Each run is a fresh interpreter that imports sdkcore, then times its first
``RetryOrchestrator.hedge`` (2 attempts, 20 ms, a ``send`` that answers at once)
and a second one, and lists the modules the first hedge imported. Anything
imported there is paid on the request's clock (issue: anyio's backend import
stalled the first hedge by tens of milliseconds).

    uv run python bench/bench_first_hedge.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys

RUNS = 5

CHILD = """
import sys, time
backend = sys.argv[1]
if backend == "trio":
    import trio
else:
    import asyncio
import sdkcore
before = set(sys.modules)

async def send(request, index):
    return index

async def main():
    orchestrator = sdkcore.RetryOrchestrator()
    policy = sdkcore.HedgePolicy(2, delay=0.02)
    times = []
    for _ in range(2):
        request = sdkcore.Request(name="get", idempotent=True, timeout=1.0)
        t0 = time.perf_counter()
        await orchestrator.hedge(request, send, policy)
        times.append(time.perf_counter() - t0)
    new = sorted(m for m in set(sys.modules) - before if not m.startswith("trio"))
    print(times[0] * 1e3, times[1] * 1e3, len(new), ",".join(new[:4]) + ("..." if new[4:] else ""))

if backend == "trio":
    trio.run(main)
else:
    asyncio.run(main())
"""


def main() -> None:
    for backend in ("asyncio", "trio"):
        firsts, seconds = [], []
        imported = ""
        for _ in range(RUNS):
            out = (
                subprocess.run(
                    [sys.executable, "-c", CHILD, backend],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=120,
                )
                .stdout.strip()
                .split(maxsplit=3)
            )
            firsts.append(float(out[0]))
            seconds.append(float(out[1]) * 1e3)
            imported = f"{out[2]} modules" + (f" ({out[3]})" if len(out) > 3 else "")
        print(
            f"{backend:8s} first hedge: median {statistics.median(firsts):7.2f} ms "
            f"(min {min(firsts):.2f}, max {max(firsts):.2f}); second: "
            f"{statistics.median(seconds):.0f} µs; imported by the first: {imported}"
        )


if __name__ == "__main__":
    main()
