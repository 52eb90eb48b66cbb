"""Request: validation, read-only retry state, ids, client_context."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest

from sdkcore import (
    DEFAULT_TIMEOUT,
    BestEffortRetryStrategy,
    CancellationReason,
    Request,
    RequestState,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore.testing import VirtualClock


def test_defaults() -> None:
    req = Request()
    assert req.idempotent is False
    assert req.timeout == DEFAULT_TIMEOUT == timedelta(milliseconds=2500)
    assert req.retry_strategy is None
    assert req.retry_attempts == 0
    assert req.retry_reasons == ()
    assert isinstance(req.client_context, Mapping)
    assert dict(req.client_context) == {}
    assert req.state is RequestState.PENDING
    assert req.completed is False
    assert req.cancelled is False
    assert req.cancellation_reason is None
    assert req.reached_network is False


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (0.25, timedelta(milliseconds=250)),
        (3, timedelta(seconds=3)),
        (timedelta(seconds=1), timedelta(seconds=1)),
    ],
)
def test_timeout_forms(timeout: Any, expected: timedelta) -> None:
    assert Request(timeout=timeout).timeout == expected


def test_timeout_none_means_no_deadline() -> None:
    req = Request(timeout=None)
    assert req.timeout is None
    assert req.time_left is None
    assert req.deadline == math.inf


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"timeout": 0}, ValueError, "Request.timeout"),
        ({"timeout": -1.0}, ValueError, "Request.timeout"),
        ({"timeout": timedelta(0)}, ValueError, "Request.timeout"),
        ({"timeout": timedelta(seconds=-2)}, ValueError, "Request.timeout"),
        ({"timeout": float("nan")}, ValueError, "Request.timeout"),
        ({"timeout": float("inf")}, ValueError, "Request.timeout"),
        ({"timeout": "1s"}, TypeError, "Request.timeout"),
        ({"timeout": True}, TypeError, "Request.timeout"),
        ({"timeout": False}, TypeError, "Request.timeout"),
        ({"idempotent": 1}, TypeError, "Request.idempotent"),
        ({"idempotent": "yes"}, TypeError, "Request.idempotent"),
        ({"name": 3}, TypeError, "Request.name"),
        ({"client_context": [("a", 1)]}, TypeError, "Request.client_context"),
        ({"client_context": "robot"}, TypeError, "Request.client_context"),
        ({"retry_strategy": object()}, TypeError, "Request.retry_strategy"),
        ({"retry_strategy": BestEffortRetryStrategy}, TypeError, "Request.retry_strategy"),
    ],
)
def test_validation_errors_name_the_field(
    kwargs: dict[str, Any], exc: type[Exception], field: str
) -> None:
    with pytest.raises(exc, match=field.replace(".", r"\.")):
        Request(**kwargs)


def test_positional_arguments_are_rejected() -> None:
    with pytest.raises(TypeError):
        Request(True)  # type: ignore[call-arg,arg-type]


@pytest.mark.parametrize(
    "attr",
    [
        "retry_attempts",
        "id",
        "retry_reasons",
        "state",
        "completed",
        "cancelled",
        "timeout",
        "deadline",
        "elapsed",
        "time_left",
        "cancellation_reason",
        "reached_network",
    ],
)
def test_retry_state_is_read_only(attr: str) -> None:
    req = Request()
    with pytest.raises(AttributeError):
        setattr(req, attr, getattr(req, attr))


def test_no_new_attributes() -> None:
    """Slotted: a typo'd attribute (``req.idempotnet = True``) is refused, not kept aside."""
    req = Request()
    assert not hasattr(req, "__dict__")
    with pytest.raises(AttributeError):
        req.idempotnet = True  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        req.attempts = 5  # type: ignore[misc,assignment]  # a read-only property


def test_ids_are_unique() -> None:
    ids = {Request().id for _ in range(2000)}
    assert len(ids) == 2000


def test_client_context_is_a_read_only_copy() -> None:
    data: dict[str, Any] = {"isRobotRequest": True}
    req = Request(client_context=data)
    assert req.client_context["isRobotRequest"] is True
    with pytest.raises(TypeError):
        req.client_context["x"] = 1  # type: ignore[index]
    data["later"] = 1
    assert "later" not in req.client_context


def test_client_context_none_is_empty_mapping() -> None:
    req = Request(client_context=None)
    assert len(req.client_context) == 0
    with pytest.raises(TypeError):
        req.client_context["x"] = 1  # type: ignore[index]


def test_time_left_and_elapsed_follow_the_clock() -> None:
    vc = VirtualClock()
    req = Request(timeout=1.0, clock=vc.clock)
    assert req.elapsed == timedelta(0)
    assert req.time_left == timedelta(seconds=1)
    vc.advance(0.4)
    assert req.elapsed == timedelta(seconds=0.4)
    assert req.time_left == timedelta(seconds=0.6)
    vc.advance(5)
    assert req.time_left == timedelta(0)
    assert req.deadline == pytest.approx(1001.0)


def test_cancel_pending_request() -> None:
    req = Request()
    req.cancel()
    assert req.completed
    assert req.cancelled
    assert req.state is RequestState.CANCELLED
    assert req.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
    req.cancel()  # idempotent
    assert req.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT


@pytest.mark.anyio
async def test_cancel_after_success_does_nothing() -> None:
    async def send(_: Request) -> str:
        return "ok"

    req = Request()
    assert await RetryOrchestrator().execute(req, send) == "ok"
    req.cancel()
    assert req.state is RequestState.SUCCEEDED
    assert req.cancelled is False


@pytest.mark.anyio
async def test_only_the_orchestrator_changes_retry_state() -> None:
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=vc.sleep)
    req = Request(timeout=None, clock=vc.clock)
    await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert req.retry_attempts == 1
    assert req.retry_reasons == (RetryReason.KV_LOCKED,)
    reasons = req.retry_reasons
    assert isinstance(reasons, tuple)  # a snapshot, not the live container


def test_repr_mentions_id_name_and_state() -> None:
    req = Request(name="upsert")
    text = repr(req)
    assert str(req.id) in text
    assert "'upsert'" in text
    assert "pending" in text


def test_a_request_that_succeeded_has_no_attempt_in_flight_on_every_door() -> None:
    """``in_flight`` is "between its start and its outcome": the answer is an outcome, and
    an attempt that answered reached the network (it stayed in flight for ever before)."""
    import anyio

    orch = RetryOrchestrator()

    async def ok(request: Request) -> str:
        return "ok"

    async def doors() -> list[Request]:
        by_execute = Request(timeout=1.0)
        await orch.execute(by_execute, ok)
        by_hand = Request(timeout=1.0)
        with orch.attempt(by_hand):
            pass
        assert by_hand.in_flight  # answered; succeed() not called yet
        orch.succeed(by_hand)
        return [by_execute, by_hand]

    done = anyio.run(doors)
    by_thread = Request(timeout=1.0)
    orch.execute_sync(by_thread, lambda request: "ok")
    for request in (*done, by_thread):
        assert request.state is RequestState.SUCCEEDED
        assert request.in_flight is False
        assert request.reached_network is True
