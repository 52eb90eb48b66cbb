"""End to end: RetryOrchestrator.execute driven by scripted KV statuses through the mappers."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from sdkcore import (
    BestEffortRetryStrategy,
    CasMismatchException,
    FailFastRetryStrategy,
    Request,
    RequestCanceledException,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore.mapping import (
    ErrorMap,
    FailureStage,
    KvOpcode,
    KvStatus,
    dispatch_failure_reason,
    kv_failure,
    kv_request,
    raise_failure,
)
from sdkcore.testing import VirtualClock

pytestmark = pytest.mark.anyio


class FakeKvServer:
    """Answers attempt n with ``statuses[n]`` (the last repeats); SUCCESS returns the opcode."""

    def __init__(self, opcode: int, statuses: Iterable[int], error_map: ErrorMap | None = None):
        self.opcode = opcode
        self.statuses = list(statuses)
        self.error_map = error_map
        self.calls = 0

    async def send(self, request: Request) -> str:
        status = self.statuses[min(self.calls, len(self.statuses) - 1)]
        self.calls += 1
        if status == KvStatus.SUCCESS:
            return f"ok after {self.calls}"
        raise_failure(kv_failure(status, self.opcode, self.error_map))


def setup(
    opcode: int, *, timeout: float = 2.5, strategy: object = None
) -> tuple[Request, RetryOrchestrator]:
    clock = VirtualClock()
    request = kv_request(opcode, timeout=timeout, clock=clock.clock, retry_strategy=strategy)
    return request, RetryOrchestrator(sleep=clock.sleep)


async def test_not_my_vbucket_three_times_then_success_on_non_idempotent_upsert() -> None:
    request, orchestrator = setup(KvOpcode.SET, strategy=FailFastRetryStrategy())
    assert not request.idempotent
    server = FakeKvServer(KvOpcode.SET, [KvStatus.NOT_MY_VBUCKET] * 3 + [KvStatus.SUCCESS])
    # Always-retry: even a fail-fast strategy does not stop NOT_MY_VBUCKET.
    assert await orchestrator.execute(request, server.send) == "ok after 4"
    assert request.retry_attempts == 3
    assert request.retry_reasons == (RetryReason.KV_NOT_MY_VBUCKET,)


async def test_locked_on_unlock_fails_at_once_with_cas_mismatch() -> None:
    request, orchestrator = setup(KvOpcode.UNLOCK)
    server = FakeKvServer(KvOpcode.UNLOCK, [KvStatus.LOCKED, KvStatus.SUCCESS])
    with pytest.raises(CasMismatchException):
        await orchestrator.execute(request, server.send)
    assert server.calls == 1
    assert request.retry_attempts == 0


async def test_locked_on_a_mutation_is_retried() -> None:
    request, orchestrator = setup(KvOpcode.REPLACE)
    server = FakeKvServer(KvOpcode.REPLACE, [KvStatus.LOCKED, KvStatus.LOCKED, KvStatus.SUCCESS])
    assert await orchestrator.execute(request, server.send) == "ok after 3"
    assert request.retry_reasons == (RetryReason.KV_LOCKED,)


async def test_tmpfail_until_timeout_on_a_get_is_an_unambiguous_timeout() -> None:
    request, orchestrator = setup(KvOpcode.GET, timeout=0.25)
    server = FakeKvServer(KvOpcode.GET, [KvStatus.TEMPORARY_FAILURE])
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orchestrator.execute(request, server.send)
    context = info.value.context
    assert context is not None
    assert context.retry_reasons == (RetryReason.KV_TEMPORARY_FAILURE,)
    assert context.retry_attempts == server.calls >= 5


async def test_busy_until_timeout_on_an_upsert_lists_tmpfail() -> None:
    request, orchestrator = setup(KvOpcode.SET, timeout=0.25)
    server = FakeKvServer(KvOpcode.SET, [KvStatus.BUSY])
    # Non-idempotent and the attempts reached the server, but BUSY (a temporary failure)
    # proves each was not applied: unambiguous (rfc/0001 "Ambiguity").
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orchestrator.execute(request, server.send)
    assert info.value.context is not None
    assert info.value.context.retry_reasons == (RetryReason.KV_TEMPORARY_FAILURE,)


async def test_error_map_retry_goes_through_the_users_strategy() -> None:
    emap = ErrorMap.from_json(
        '{"version": 2, "revision": 1, "errors": {"7ff0": {"name": "NEW_TEMP", "desc": "d",'
        ' "attrs": ["temp", "retry-now"]}}}'
    )
    request, orchestrator = setup(KvOpcode.SET, strategy=BestEffortRetryStrategy())
    server = FakeKvServer(KvOpcode.SET, [0x7FF0, KvStatus.SUCCESS], emap)
    assert await orchestrator.execute(request, server.send) == "ok after 2"
    assert request.retry_reasons == (RetryReason.KV_ERROR_MAP_RETRY_INDICATED,)

    # The same status under a fail-fast strategy is not retried: the map never overrides it.
    request, orchestrator = setup(KvOpcode.SET, strategy=FailFastRetryStrategy())
    server = FakeKvServer(KvOpcode.SET, [0x7FF0, KvStatus.SUCCESS], emap)
    with pytest.raises(RequestCanceledException):
        await orchestrator.execute(request, server.send)
    assert server.calls == 1


async def test_socket_closed_in_flight_retries_only_idempotent_requests() -> None:
    async def closes_once(request: Request) -> str:
        if request.retry_attempts == 0:
            raise_failure(dispatch_failure_reason(FailureStage.IN_FLIGHT))
        return "ok"

    get, orchestrator = setup(KvOpcode.GET)
    assert await orchestrator.execute(get, closes_once) == "ok"
    assert get.retry_reasons == (RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT,)

    upsert, orchestrator = setup(KvOpcode.SET)
    with pytest.raises(RequestCanceledException) as info:
        await orchestrator.execute(upsert, closes_once)
    assert info.value.context is not None
    assert info.value.context.reason is RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT
