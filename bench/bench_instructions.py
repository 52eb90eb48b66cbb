"""Instructions per call on the core's doors, counted by valgrind: repeatable A/B figures.

Run:  uv run python bench/bench_instructions.py [--tree DIR ...] [--case NAME ...]

Wall-clock ratios on a shared 2-core machine move by ±0.05 from run to run, which
hides a change worth 1-3%. ``valgrind --tool=callgrind`` counts the instructions the
interpreter executes instead: the same figure on every run of the same code, whatever
else the machine does. Each case runs ``N`` and ``3N`` calls in fresh interpreters; the
difference over ``2N`` is the cost of one call, start-up and warm-up excluded.

Cases (the call of ``bench_doors.py``: 3 retryable failures, zero backoff, success):
``hand`` (``anyio.sleep(0)`` between attempts, the reference), ``hand-native``
(``asyncio.sleep(0)``), ``execute``, ``execute+deadline`` (``timeout=2.5``),
``maybe_retry`` (a hand-wired loop), ``happy+deadline`` (one successful call).

``--tree DIR`` (repeatable) runs the cases against the ``sdkcore`` package found in
DIR (e.g. ``git archive <rev> sdkcore | tar -x -C DIR``), to compare revisions;
default: this checkout. Needs valgrind (Debian: ``apt-get install valgrind``); about
15 s per case and tree. asyncio only: trio's run loop is the same for every tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

WORKLOAD = r"""
import asyncio, logging, sys
import structlog
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    cache_logger_on_first_use=True,
)
from bench_doors import failing  # the call of bench_doors.py
from sdkcore import BestEffortRetryStrategy, Request, RetryableError, RetryOrchestrator

orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: 0.0))

async def main(case, calls):
    send = failing(3)
    if case in ("hand", "hand-native"):
        if case == "hand":
            import anyio
            pause = anyio.sleep
        else:
            pause = asyncio.sleep
        for _ in range(calls):
            while True:
                try:
                    await send(None)
                    break
                except RetryableError:
                    await pause(0)
    elif case == "execute":
        for _ in range(calls):
            await orch.execute(Request(idempotent=True, timeout=None), send)
    elif case == "execute+deadline":
        for _ in range(calls):
            await orch.execute(Request(idempotent=True, timeout=2.5), send)
    elif case == "happy+deadline":
        ok = failing(0)
        for _ in range(calls):
            await orch.execute(Request(idempotent=True, timeout=2.5), ok)
    elif case == "maybe_retry":
        for _ in range(calls):
            request = Request(idempotent=True, timeout=None)
            while True:
                try:
                    await send(request)
                except RetryableError as failure:
                    await orch.maybe_retry(request, failure.reason, cause=failure)
                    continue
                orch.succeed(request)
                break
    else:
        raise SystemExit(f"unknown case {case!r}")

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

CASES = ["hand", "hand-native", "execute", "execute+deadline", "maybe_retry", "happy+deadline"]


def instructions(tree: Path, case: str, calls: int) -> int:
    # sdkcore from ``tree`` (the working directory comes first on sys.path for
    # ``python -c``), bench_doors from this directory
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent))
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-c",
            WORKLOAD,
            case,
            str(calls),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count from valgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="a directory holding sdkcore/")
    parser.add_argument("--case", action="append", choices=CASES)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    trees = [t.resolve() for t in args.tree or [Path(__file__).resolve().parent.parent]]
    cases = args.case or CASES
    for tree in trees:  # compiled once, so no run pays for compiling
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", str(tree / "sdkcore")], check=True
        )
    print(f"instructions per call ({args.calls} and {3 * args.calls} calls, fresh interpreters)")
    for tree in trees:
        print(f"tree {tree}")
        reference = None
        for case in cases:
            per_call = (
                instructions(tree, case, 3 * args.calls) - instructions(tree, case, args.calls)
            ) // (2 * args.calls)
            if case == "hand":
                reference = per_call
            ratio = (
                "" if reference is None or case == "hand" else f"  {per_call / reference:.2f}x hand"
            )
            print(f"  {case:17s} {per_call:8d}{ratio}")


if __name__ == "__main__":
    main()
