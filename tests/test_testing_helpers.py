"""sdkcore.testing: ScriptedSend, VirtualClock, capture_retry_events."""

from __future__ import annotations

import pytest
import structlog

from sdkcore import Request, RetryableError, RetryReason
from sdkcore.testing import ScriptedSend, VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio


async def test_scripted_send_plays_steps_then_repeats_the_last() -> None:
    boom = ValueError("boom")
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, boom, "ok"])
    req = Request()
    with pytest.raises(RetryableError) as info:
        await send(req)
    assert info.value.reason is RetryReason.KV_LOCKED
    with pytest.raises(ValueError, match="boom") as info2:
        await send(req)
    assert info2.value is boom
    assert await send(req) == "ok"
    assert await send(req) == "ok"
    assert send.calls == 4
    assert send.seen == [0, 0, 0, 0]


def test_scripted_send_needs_a_step() -> None:
    with pytest.raises(ValueError, match="at least one step"):
        ScriptedSend([])


async def test_virtual_clock() -> None:
    vc = VirtualClock(start=5.0)
    assert vc.clock() == 5.0
    vc.advance(1.5)
    assert vc.clock() == 6.5
    await vc.sleep(0.25)
    await vc.sleep(0)
    assert vc.clock() == 6.75
    assert vc.sleeps == [0.25, 0]


def test_capture_keeps_only_sdkcore_events() -> None:
    log = structlog.get_logger("app")
    with capture_retry_events() as events:
        log.info("user.event", x=1)
        log.debug("retry.scheduled", attempt=1)
    assert events == [{"event": "retry.scheduled", "attempt": 1, "log_level": "debug"}]
