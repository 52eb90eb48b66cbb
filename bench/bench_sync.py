"""execute_sync against a hand-written blocking loop, interleaved in one process.

Run:  uv run python bench/bench_sync.py [--rounds 9] [--calls 50000]

Cases (each beside its baseline, round by round, order rotated; the median of the
rounds of (case - baseline) per call is printed, and the median microseconds):

* happy: ``execute_sync(Request(idempotent=True), send)`` against a bare ``send(None)``;
* retried: one retryable failure, zero backoff, then success, against ``for`` + ``try``
  + ``except``, raising the same ``RetryableError``.

To compare two trees, run it from each with ``PYTHONPATH`` (from a directory outside
the project, so that the other tree is the one imported): the figures are per call, and
the baselines show whether the two runs saw the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from sdkcore import (
    BestEffortRetryStrategy,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
)

REASON = RetryReason.KV_TEMPORARY_FAILURE
ORCH = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))


class Flaky:
    """Fails every other call with a RetryableError."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, request: object) -> int:
        self.n += 1
        if self.n % 2:
            raise RetryableError(REASON)
        return 1


def send(request: object) -> int:
    return 1


def bare(calls: int) -> None:
    for _ in range(calls):
        send(None)


def happy(calls: int) -> None:
    for _ in range(calls):
        ORCH.execute_sync(Request(idempotent=True), send)


def hand_retried(calls: int) -> None:
    op = Flaky()
    for _ in range(calls):
        for _attempt in range(4):
            try:
                op(None)
                break
            except RetryableError:
                continue


def retried(calls: int) -> None:
    op = Flaky()
    for _ in range(calls):
        ORCH.execute_sync(Request(idempotent=True), op)


PAIRS: dict[str, tuple[Callable[[int], None], Callable[[int], None]]] = {
    "happy": (happy, bare),
    "retried": (retried, hand_retried),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=50_000)
    args = parser.parse_args()
    times: dict[str, list[float]] = {
        name: [] for pair in PAIRS.values() for name in (pair[0].__name__, pair[1].__name__)
    }
    fns = [fn for pair in PAIRS.values() for fn in pair]
    for r in range(args.rounds):
        order = fns[r % len(fns) :] + fns[: r % len(fns)]
        for fn in order:
            start = time.perf_counter()
            fn(args.calls)
            times[fn.__name__].append((time.perf_counter() - start) / args.calls * 1e6)
    for case, (fn, base) in PAIRS.items():
        added = statistics.median(
            a - b for a, b in zip(times[fn.__name__], times[base.__name__], strict=True)
        )
        print(
            f"{case:8} {statistics.median(times[fn.__name__]):6.3f} us/call, baseline "
            f"{statistics.median(times[base.__name__]):6.3f} us: +{added:.3f} us"
        )


if __name__ == "__main__":
    main()
