"""Orphaned responses (RFC 67) from the async memcached client, against a real memcached.

The fault proxy holds each reply ``DELAY`` seconds, one after the other. An attempt cut
on a connection that stays open (its deadline passed after another reply arrived, or
the caller cancelled it) leaves its reply to arrive later: the client reports it to
its ``OrphanReporter`` with the opcode, the opaque, the sockets and the timeout.

The reporter's clock is frozen, so nothing is emitted by itself: the tests read
``report()`` and then ``flush()`` it. Durations are checked by their relations only.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import TimeoutException
from sdkcore._orphans import OrphanReporter
from sdkcore.examples.memcached import MemcachedClient
from sdkcore.testing import capture_retry_events

pytestmark = pytest.mark.anyio

DELAY = 1.0  # the proxy holds each reply this long
ENTRY_FIELDS = {
    "total_duration_us",
    "last_dispatch_duration_us",
    "operation_name",
    "operation_id",
    "last_local_socket",
    "last_remote_socket",
    "timeout_ms",
}


def frozen() -> OrphanReporter:
    return OrphanReporter(clock=lambda: 0.0)


async def orphans(reporter: OrphanReporter) -> dict[str, Any]:
    """The pending report, once the late reply has come in (a safety bound, not a timing)."""
    with anyio.fail_after(15):
        while (report := reporter.report()) is None:  # noqa: ASYNC110 - a reader task records it
            await anyio.sleep(0.02)
    return report


async def test_get_timed_out_while_the_proxy_delays_its_reply_is_an_orphan(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """Two pipelined GETs, timeout between one and two delays: the second one's reply is late.

    The first reply arrives after DELAY (the first GET succeeds); the second GET's
    deadline cuts it at 1.5 * DELAY, on a connection that has just received a reply,
    so the connection is kept; its reply arrives at 2 * DELAY: an orphan.
    """
    reporter = frozen()
    target = f"127.0.0.1:{proxy.port}"
    async with MemcachedClient(target) as direct:
        await direct.set("slow", b"value")
    outcomes: list[object] = []

    async def get(client: MemcachedClient) -> None:
        try:
            outcomes.append(await client.get("slow"))
        except TimeoutException as exc:
            outcomes.append(exc)

    with anyio.fail_after(30):
        async with MemcachedClient(target, timeout=1.5 * DELAY, orphan_reporter=reporter) as client:
            await client.noop()  # connected before the two GETs are written back to back
            proxy.delay = DELAY
            proxy.reset_counts()
            async with anyio.create_task_group() as tg:
                tg.start_soon(get, client)
                tg.start_soon(get, client)
            assert len(outcomes) == 2
            assert b"value" in outcomes  # the first one written
            assert any(isinstance(o, TimeoutException) for o in outcomes)  # the second
            report = await orphans(reporter)

    assert list(report) == ["kv"]
    assert report["kv"]["total_count"] == 1
    [entry] = report["kv"]["top_requests"]
    assert set(entry) == ENTRY_FIELDS
    assert entry["operation_name"] == "get"
    assert entry["operation_id"].startswith("0x")
    int(entry["operation_id"], 16)  # the opaque, in hex
    assert entry["timeout_ms"] == 1500
    assert entry["last_remote_socket"] == target
    assert entry["last_local_socket"].startswith("127.0.0.1:")
    assert entry["last_local_socket"] != target
    # cut at its deadline, answered later: the wait is shorter than the answer's time
    assert 0 < entry["last_dispatch_duration_us"] < entry["total_duration_us"]
    assert entry["total_duration_us"] >= DELAY * 1_000_000 * 0.9
    _, _, requests = proxy.counts()
    assert sum(requests.values()) == 2  # one frame per GET: the orphan was not a retry

    with capture_retry_events() as events:
        assert reporter.flush() == report
    assert [e["event"] for e in events] == ["orphan.report"]
    assert events[0]["log_level"] == "warning"
    assert reporter.report() is None


async def test_get_cancelled_by_the_caller_is_an_orphan(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """The caller gives up (a cancel scope, not the request's deadline): the reply is late."""
    reporter = frozen()
    target = f"127.0.0.1:{proxy.port}"
    async with MemcachedClient(target) as direct:
        await direct.set("k", b"v")
    proxy.delay = DELAY
    with anyio.fail_after(30):
        async with MemcachedClient(target, timeout=20.0, orphan_reporter=reporter) as client:
            with anyio.move_on_after(DELAY / 2) as scope:
                await client.get("k")
            assert scope.cancelled_caught
            report = await orphans(reporter)
            proxy.delay = 0.0
            assert await client.get("k") == b"v"  # the connection is still good
    [entry] = report["kv"]["top_requests"]
    assert entry["operation_name"] == "get"
    assert entry["timeout_ms"] == 20_000
    assert entry["last_remote_socket"] == target
    assert 0 < entry["last_dispatch_duration_us"] < entry["total_duration_us"]
    assert report["kv"]["total_count"] == 1


async def test_without_a_reporter_a_late_reply_is_dropped(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    """No orphan_reporter: the client keeps no record of cut attempts (nothing to report)."""
    target = f"127.0.0.1:{proxy.port}"
    proxy.delay = DELAY
    with anyio.fail_after(30):
        async with MemcachedClient(target, timeout=20.0) as client:
            with anyio.move_on_after(DELAY / 2):
                await client.noop()
            proxy.delay = 0.0
            await anyio.sleep(DELAY)  # the late NOOP reply arrives meanwhile
            await client.noop()
            connection = client._endpoints[0]._connection
            assert connection is not None
            assert connection.cut == {}


def test_orphan_reporter_must_be_an_orphan_reporter() -> None:
    with pytest.raises(TypeError, match=r"MemcachedClient\(orphan_reporter\) must be"):
        MemcachedClient("127.0.0.1:11211", orphan_reporter=object())  # type: ignore[arg-type]
