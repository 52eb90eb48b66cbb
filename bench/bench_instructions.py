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

Pieces (``--case piece-...``; not run by default): the parts of ``happy+deadline``, each
alone as an awaited call in the same loop (``piece-loop``: the loop with an empty call):
``piece-bare`` (the send), ``piece-request`` (``Request(timeout=2.5)``), ``piece-happy``
(``execute`` without a deadline), ``piece-scope`` and ``piece-scope+deadline`` (the
runtime's ``Scope`` without and with a deadline), ``piece-mark`` (the deadline-propagation
mark), ``piece-clock`` (one ``time.monotonic()``).

Trio cases (``--case trio-...``; not run by default): the same call under ``trio.run``.
``trio-hand`` (``trio.sleep(0)`` between attempts), ``trio-hand+scope`` (the same loop
inside one ``trio.CancelScope`` with a deadline, what a deadline costs at the least on
trio), ``trio-execute`` and ``trio-execute+deadline``: whether sdkcore's deadline costs
more than the scope it arms (issue 24, target 3).

gRPC cases (``--case grpc-...``; not run by default: they import grpcio): sdkcore's
own work on an sdkcore channel, with grpc.aio's call object replaced by a stand-in
that is over when awaited. ``grpc-bare`` awaits the stand-in alone; ``grpc-ok`` and
``grpc-ok-policy`` make an OK call through the channel without and with a
retryPolicy (``timeout=10``); ``grpc-hand`` retries a failed first attempt by hand
(catch, sleep below 1 us, call again); ``grpc-retried`` is the same through the
channel's retryPolicy. The difference to the reference is sdkcore's share.
``grpc-not-found``: every call's first attempt answers NOT_FOUND, a status the
method's retryPolicy does not list (an ordinary answer), caught by the caller.
``grpc-real-hand``, ``grpc-real-interceptor`` and ``grpc-real-sdkcore`` retry the same
call on a real loopback server (bench_grpc_cpu.py's, in a subprocess valgrind does not
follow), counting the whole client process, grpc's threads included: a hand loop, the
15-line retry interceptor of bench_grpc_cpu.py, and an sdkcore channel (use
``--calls 150``: each run takes about 20 s under valgrind).

``--tree DIR`` (repeatable) runs the cases against the ``sdkcore`` package found in
DIR (e.g. ``git archive <rev> sdkcore | tar -x -C DIR``), to compare revisions;
default: this checkout. Needs valgrind (Debian: ``apt-get install valgrind``); about
15 s per case and tree.
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
import asyncio, logging, math, sys
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
    elif case.startswith("piece-"):  # one part of a call with a deadline, alone
        from sdkcore import _runtime

        rt = _runtime.current()
        request = Request(idempotent=True, timeout=2.5)

        async def piece(_=None):  # piece-loop: the loop and an awaited call, alone
            pass

        if case == "piece-bare":
            piece = answer
        elif case == "piece-request":
            async def piece(_=None):
                Request(idempotent=True, timeout=2.5)
        elif case == "piece-happy":
            async def piece(_=None):
                await orch.execute(Request(idempotent=True, timeout=None), answer)
        elif case == "piece-scope":
            async def piece(_=None):
                rt.Scope(math.inf).exit(None)
        elif case == "piece-scope+deadline":
            async def piece(_=None):
                rt.Scope(rt.now() + 2.5).exit(None)
        elif case == "piece-mark":
            async def piece(_=None):
                Request._dispatched_done(request._dispatching())
        elif case == "piece-clock":
            async def piece(_=None):
                request._clock()
        elif case != "piece-loop":
            raise SystemExit(f"unknown case {case!r}")
        for _ in range(calls):
            await piece(None)
    else:
        raise SystemExit(f"unknown case {case!r}")

answer = failing(0)  # the pieces' successful send
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

# The same call under trio.run: a hand loop with and without one deadline scope, and execute.
TRIO_WORKLOAD = r"""
import logging, sys
import structlog
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    cache_logger_on_first_use=True,
)
import trio
from bench_doors import failing
from sdkcore import BestEffortRetryStrategy, Request, RetryableError, RetryOrchestrator

orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: 0.0))

async def hand(send):
    while True:
        try:
            return await send(None)
        except RetryableError:
            await trio.sleep(0)

async def main(case, calls):
    send = failing(3)
    if case == "trio-hand":
        for _ in range(calls):
            await hand(send)
    elif case == "trio-hand+scope":
        for _ in range(calls):
            with trio.CancelScope(deadline=trio.current_time() + 2.5):
                await hand(send)
    elif case == "trio-execute":
        for _ in range(calls):
            await orch.execute(Request(idempotent=True, timeout=None), send)
    elif case == "trio-execute+deadline":
        for _ in range(calls):
            await orch.execute(Request(idempotent=True, timeout=2.5), send)
    else:
        raise SystemExit(f"unknown case {case!r}")

trio.run(main, sys.argv[1], int(sys.argv[2]))
"""

# sdkcore's own work on a gRPC channel: grpc.aio's call replaced by a stand-in that
# answers at once (OK, or UNAVAILABLE on every other attempt), so that only sdkcore's
# instructions are counted. The channel is connected to a real (idle) server first, so
# that it is READY as in production. What a real call costs is bench_grpc_cpu.py's.
GRPC_WORKLOAD = r"""
import asyncio, json, random, sys
import grpc
from grpc import aio
from sdkcore.grpc import insecure_channel

random.seed(1)
POLICY = json.dumps({"methodConfig": [{"name": [{"service": "b.S"}], "retryPolicy": {
    "maxAttempts": 2, "initialBackoff": "0.000001s", "maxBackoff": "0.000001s",
    "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]})
EMPTY = aio.Metadata()

class Status:  # what sdkcore reads of grpc's Cython call: is_ok()
    def __init__(self, ok):
        self.ok = ok
    def is_ok(self):
        return self.ok

class StandIn:  # a grpc.aio unary call that is over when awaited: OK, or failed with code
    def __init__(self, code):
        self.callbacks = []
        self.code = code
        self._cython_call = Status(code is None)
    def add_done_callback(self, cb):
        self.callbacks.append(cb)
    def cancelled(self):
        return False
    def done(self):
        return True
    def __await__(self):
        if False:
            yield
        for cb in self.callbacks:
            cb(self)
        if self.code is not None:
            raise aio.AioRpcError(self.code, EMPTY, EMPTY, "down")
        return b"ok"

def inner_for(answers):  # the stand-in's answers in turn: None (OK) or a status code
    sent = [0]
    def inner(message, timeout=None, metadata=None, credentials=None,
              wait_for_ready=None, compression=None):
        sent[0] += 1
        return StandIn(answers[sent[0] % len(answers)])
    return inner

UNAVAILABLE_THEN_OK = (None, grpc.StatusCode.UNAVAILABLE)  # attempt 1 fails, 2 answers
ANSWERS = {
    "grpc-hand": UNAVAILABLE_THEN_OK,
    "grpc-retried": UNAVAILABLE_THEN_OK,
    "grpc-not-found": (grpc.StatusCode.NOT_FOUND,),  # an ordinary answer: not retried
}

async def main(case, calls):
    inner = inner_for(ANSWERS.get(case, (None,)))
    policy = POLICY if case in ("grpc-ok-policy", "grpc-retried", "grpc-not-found") else None
    server = aio.server()  # a real server, so that the channel is READY as in production
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{port}", service_config=policy)
    await channel.channel_ready()
    if case == "grpc-bare":
        for _ in range(calls):
            await inner(b"x", timeout=10)
    elif case == "grpc-hand":  # the retry written by hand: catch, sleep, call again
        for _ in range(calls):
            for attempt in (1, 2):
                try:
                    await inner(b"x", timeout=10)
                    break
                except aio.AioRpcError as err:
                    if attempt == 2 or err.code() is not grpc.StatusCode.UNAVAILABLE:
                        raise
                await asyncio.sleep(0.000001 * random.random())
    elif case == "grpc-not-found":
        mc = channel.unary_unary("/b.S/M")
        call = type(mc)(mc._core, mc._plan, inner, mc._method)
        for _ in range(calls):
            try:
                await call(b"x", timeout=10)
            except aio.AioRpcError:
                pass
    else:  # sdkcore's channel: its multi-callable, around the stand-in
        mc = channel.unary_unary("/b.S/M")  # the multi-callable the channel chose
        call = type(mc)(mc._core, mc._plan, inner, mc._method)
        for _ in range(calls):
            await call(b"x", timeout=10)
    await channel.close()
    await server.stop(None)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

# A retried call on a real loopback server (bench_grpc_cpu.py's, in a subprocess that
# valgrind does not follow): the whole client process is counted, grpc's threads included.
# Eight callers; each call's first attempt fails with UNAVAILABLE, its retry succeeds.
GRPC_REAL_WORKLOAD = r"""
import asyncio, random, sys
import grpc
from grpc import aio
import bench_grpc_cpu as b
from sdkcore.grpc import insecure_channel

random.seed(1)

async def main(case, calls, port):
    target = f"127.0.0.1:{port}"
    if case == "grpc-real-sdkcore":
        channel = insecure_channel(target, service_config=b.CONFIG)
        call = channel.unary_unary(b.FAIL_ONCE)
    elif case == "grpc-real-interceptor":
        channel = aio.insecure_channel(target, interceptors=[b.HandRetry()])
        call = channel.unary_unary(b.FAIL_ONCE)
    else:  # grpc-real-hand: catch, sleep as A6 does, call again with the time left
        channel = aio.insecure_channel(target)
        plain = channel.unary_unary(b.FAIL_ONCE)
        async def call(request, timeout):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            try:
                return await plain(request, timeout=timeout)
            except aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
            await asyncio.sleep(0.01 * random.random())
            return await plain(request, timeout=deadline - loop.time())
    await channel.channel_ready()
    async def caller(k):
        for i in range(calls // 8):
            await call(b"%d:%d:%d" % (calls, k, i), timeout=10)
    await asyncio.gather(*(caller(k) for k in range(8)))
    await channel.close()

proc, port = b.start_server(None)
try:
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), port))
finally:
    proc.stdin.close()
    proc.wait()
"""

CASES = ["hand", "hand-native", "execute", "execute+deadline", "maybe_retry", "happy+deadline"]
#: The parts of ``happy+deadline``, each alone in the same loop (``piece-loop``: the loop itself).
PIECES = [
    "piece-loop",
    "piece-bare",
    "piece-request",
    "piece-happy",
    "piece-scope",
    "piece-scope+deadline",
    "piece-mark",
    "piece-clock",
]
TRIO_CASES = ["trio-hand", "trio-hand+scope", "trio-execute", "trio-execute+deadline"]
#: The gRPC cases and the case each is compared with (sdkcore's share: the difference).
GRPC_CASES = {
    "grpc-bare": None,
    "grpc-ok": "grpc-bare",
    "grpc-ok-policy": "grpc-bare",
    "grpc-hand": None,
    "grpc-retried": "grpc-hand",
    "grpc-not-found": None,
    "grpc-real-hand": None,
    "grpc-real-interceptor": "grpc-real-hand",
    "grpc-real-sdkcore": "grpc-real-hand",
}


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
            TRIO_WORKLOAD
            if case in TRIO_CASES
            else GRPC_REAL_WORKLOAD
            if case.startswith("grpc-real")
            else GRPC_WORKLOAD
            if case in GRPC_CASES
            else WORKLOAD,
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
    parser.add_argument(
        "--case", action="append", choices=CASES + PIECES + TRIO_CASES + list(GRPC_CASES)
    )
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
        seen: dict[str, int] = {}
        for case in cases:
            per_call = (
                instructions(tree, case, 3 * args.calls) - instructions(tree, case, args.calls)
            ) // (2 * args.calls)
            if case in GRPC_CASES:
                seen[case] = per_call
                base = GRPC_CASES[case]
                if base is not None and base in seen:
                    print(f"  {case:22s} {per_call:8d}  {per_call - seen[base]:+d} over {base}")
                else:
                    print(f"  {case:22s} {per_call:8d}")
                continue
            if case in PIECES:
                print(f"  {case:21s} {per_call:8d}")
                continue
            if case in ("hand", "trio-hand"):
                reference = per_call
            ratio = (
                ""
                if reference is None or case in ("hand", "trio-hand")
                else f"  {per_call / reference:.2f}x hand"
            )
            print(f"  {case:21s} {per_call:8d}{ratio}")


if __name__ == "__main__":
    main()
