"""A typed tour of the public API, checked by ``mypy --strict`` (see pyproject).

If a change to sdkcore breaks how users are meant to write code, mypy fails here.
"""

from __future__ import annotations

from datetime import timedelta

import anyio

import sdkcore
from sdkcore import (
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    CouchbaseException,
    ErrorContext,
    FailFastRetryStrategy,
    Request,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
    controlled_backoff,
    exponential_backoff,
)


class NoRobots(BestEffortRetryStrategy):
    """The RFC's "isRobotRequest" example."""

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.client_context.get("isRobotRequest"):
            return RetryAction.no_retry()
        return await super().retry_after(request, reason)


class SyncStrategy:
    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.retry_attempts >= 3:
            return RetryAction.no_retry(AuthenticationFailureException)
        return RetryAction.with_duration(timedelta(milliseconds=10))


def translate(context: ErrorContext) -> BaseException:
    return CouchbaseException("custom", context=context)


strategies: list[RetryStrategy] = [
    NoRobots(),
    SyncStrategy(),
    FailFastRetryStrategy(),
    BestEffortRetryStrategy(backoff=exponential_backoff(0.01, 1.0)),
    BestEffortRetryStrategy(backoff=lambda attempt: 0.05 * attempt),
]
refuse: RetryAction = RetryAction.no_retry(translate)
first: timedelta = controlled_backoff(0)


async def send(request: Request) -> bytes:
    if request.retry_attempts < 2:
        raise RetryableError(RetryReason.KV_NOT_MY_VBUCKET)
    return b"value"


async def main() -> None:
    orchestrator = RetryOrchestrator(default_strategy=NoRobots(), max_requests_in_retry=1024)
    request = Request(
        name="get", idempotent=True, timeout=2.5, client_context={"isRobotRequest": False}
    )
    value: bytes = await orchestrator.execute(request, send)
    reasons: tuple[RetryReason, ...] = request.retry_reasons
    attempts: int = request.retry_attempts

    # Hand-wired dispatch loop.
    other = Request(name="upsert", timeout=timedelta(seconds=1), retry_strategy=SyncStrategy())
    while True:
        try:
            value = await send(other)
            break
        except RetryableError as failure:
            waited: timedelta = await orchestrator.maybe_retry(other, failure.reason)
            assert waited >= timedelta(0)
        except sdkcore.TimeoutException as exc:
            ctx: ErrorContext | None = exc.context
            raise RuntimeError(str(ctx)) from exc
    del value, reasons, attempts


if __name__ == "__main__":
    anyio.run(main)
