"""``sdkcore demo --scenario memcached-outage``: a real memcached killed and restarted.

The scenario runs once (about 3 s) against real memcached processes that it starts
itself; its numbers are checked here. Without memcached these tests skip locally
(naming ``apt-get install memcached``) and fail under CI=true, as tests/memcached
do; the demo's own behaviour without memcached (one line, exit 0) is tested with a
PATH that has no memcached.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from memcached_server import INSTALL, memcached_binary

from sdkcore._demo import SCENARIO_NAMES, main
from sdkcore._demo._mcserver import CountingProxy, MemcachedProcess
from sdkcore._demo._memcached_report import (
    BREAKER,
    BUDGET_REQUESTS,
    NAME,
    OUTAGE,
    RESERVE,
    SKIP_LINE,
)
from sdkcore._demo._memcached_text import UNEXPECTED
from sdkcore.mapping import KvOpcode

ROOT = Path(__file__).resolve().parent.parent.parent
PERCENT = 0.2


@pytest.fixture(scope="module")
def outage() -> dict[str, Any]:
    """One run of the scenario through the demo's runner: JSON, text, streamed lines."""
    pytest.importorskip("grpc")
    memcached_binary()
    from sdkcore._demo._report import render_tail, render_text, to_json
    from sdkcore._demo._run import run

    emitted: list[list[str]] = []
    at: list[float] = []

    def emit(lines: list[str]) -> None:
        emitted.append(lines)
        at.append(time.monotonic())

    report = asyncio.run(run([NAME], progress=False, emit=emit))
    data = to_json(report)
    data["_text"] = render_text(report)
    data["_streamed"] = [line for chunk in emitted for line in chunk] + render_tail(report)
    data["_chunks"] = list(zip(at, emitted, strict=True))
    return data


def test_the_scenario_is_listed_last() -> None:
    assert SCENARIO_NAMES[-1] == NAME


def test_breaker_opens_after_the_kill_and_the_canary_closes_it_after_the_restart(
    outage: dict[str, Any],
) -> None:
    m = outage["memcached"]
    assert m["skipped"] is False
    a = [(t["t_s"], t["state"], t["cause"]) for t in m["transitions"] if t["endpoint"] == "a"]
    states = [state for _, state, _ in a]
    assert states[0] == "open"  # tripped by the outage, not before
    assert a[0][0] >= m["killed_at_s"]
    assert "half_open" in states
    assert states[-1] == "closed"
    assert a[-1][2] == "the NOOP canary was answered"
    closes = [t for t, state, _ in a if state == "closed"]
    # it stayed open until memcached was back (on a loaded machine it may trip once more
    # just after the restart, and close again: every close comes after the restart)
    assert m["killed_at_s"] < m["restarted_at_s"] <= m["closed_at_s"] == closes[0], a
    # B was never killed: its breaker never moved, and all its requests succeeded
    assert not [t for t in m["transitions"] if t["endpoint"] == "b"]
    assert m["steady"]["requests"] > 0
    assert m["steady"]["succeeded"] == m["steady"]["requests"]


def test_the_dead_endpoint_sees_at_most_one_probe_per_sleep_window(
    outage: dict[str, Any],
) -> None:
    m = outage["memcached"]
    o = m["outage"]
    windows = (m["restarted_at_s"] - m["tripped_at_s"]) / BREAKER["sleep_window"]
    assert abs(windows - o["sleep_windows"]) < 0.01
    after = o["frames_after_trip"]
    assert set(after) <= {"NOOP", "GET", "SET"}
    assert 1 <= after.get("NOOP", 0) == o["probes"] <= int(windows) + 1
    # only the probes, and at most a few dispatches let through just before the trip
    assert sum(after.values()) - o["probes"] <= 5
    # while it was open, far more requests were issued than frames reached A
    assert o["requests_while_open"] > 5 * sum(after.values())
    assert sum(o["frames_before_trip"].values()) >= BREAKER["volume_threshold"] // 2


def test_requests_succeed_again_after_the_restart(outage: dict[str, Any]) -> None:
    m = outage["memcached"]
    recovered = m["recovered"]
    assert recovered["requests"] > 0
    # a failure names itself (what it raised, how long after the close) beside the
    # breaker's timeline
    assert recovered["succeeded"] == recovered["requests"], "\n".join(
        # a string, shown whole (a tuple's repr is cut at 240 characters): the errors first
        [*recovered["first_errors"], f"recovered: {recovered}", f"transitions: {m['transitions']}"]
    )
    assert recovered["failures"] == {}
    assert recovered["first_errors"] == []
    outcomes = m["outage"]["outcomes"]
    assert outcomes.get("timed_out", 0) > 0  # requests to the dead A timed out
    assert UNEXPECTED not in outcomes
    assert m["errors"] == []


def test_the_budget_holds_during_a_total_outage(outage: dict[str, Any]) -> None:
    budget = outage["memcached"]["budget"]
    bound = BUDGET_REQUESTS * (1 + PERCENT) + RESERVE
    assert budget["bound"] == bound
    with_budget = budget["runs"]["with_budget"]
    without = budget["runs"]["without_budget"]
    assert with_budget["first_attempts"] == without["first_attempts"] == BUDGET_REQUESTS
    assert BUDGET_REQUESTS <= with_budget["attempts"] <= bound
    assert with_budget["frames_at_endpoint"] <= with_budget["attempts"]
    assert with_budget["refused_by_budget"] > 0
    assert without["refused_by_budget"] == 0
    assert without["attempts"] > bound  # retries multiply without it


def test_checks_hold_and_the_text_report_streams(outage: dict[str, Any]) -> None:
    m = outage["memcached"]
    assert m["checks"]
    assert all(m["checks"].values()), m["checks"]
    assert m["ok"] is True
    assert outage["ok"] is True
    text = outage["_text"]
    assert outage["_streamed"] == text  # streamed as it ran, line for line
    assert text[0] == "sdkcore demo: a memcached outage"
    assert max(len(line) for line in text) <= 100
    joined = "\n".join(text)
    assert f"Scenario {NAME}: memcached " in joined
    assert "memcached A killed" in joined
    assert "memcached A restarted" in joined
    assert "memcached A listening again" in joined
    assert "A's breaker closed: the NOOP canary was answered" in joined
    assert "OK: A's breaker opened and closed around the restart" in joined
    assert "Writes (non-idempotent)" not in joined  # no gRPC scenario ran


def test_the_scenario_streams_as_it_runs(outage: dict[str, Any]) -> None:
    chunks: list[tuple[float, list[str]]] = outage["_chunks"]

    def when(text: str) -> float:
        found = [t for t, lines in chunks if any(text in line for line in lines)]
        assert len(found) == 1, text
        return found[0]

    # the set-up as soon as memcached listens, each event as it happens, each part's
    # figures as it ends: not the whole block at the end
    head, killed = when(f"Scenario {NAME}: memcached"), when("memcached A killed")
    restarted, closed = when("memcached A restarted"), when("A's breaker closed")
    figures, table = when("While A's breaker was open"), when("Total outage:")
    assert head < killed < restarted <= closed <= figures < table
    assert restarted - killed >= OUTAGE / 2  # each line went out as it happened
    assert table - killed >= OUTAGE / 2
    assert len([c for c in chunks if c[0] >= head]) >= 8


def test_json_keys_are_snake_case_identifiers(outage: dict[str, Any]) -> None:
    m = outage["memcached"]
    bad: list[str] = []

    def walk(doc: Any, path: str) -> None:
        if isinstance(doc, dict):
            verbatim = path.rsplit(".", 1)[-1] in ("frames_before_trip", "frames_after_trip")
            for key, value in doc.items():
                if not verbatim and not re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", key):
                    bad.append(f"{path}.{key}")
                walk(value, f"{path}.{key}")
        elif isinstance(doc, list):
            for value in doc:
                walk(value, path)

    walk(m, "memcached")
    assert bad == []
    assert set(m["endpoints"]) == {"a", "b"}
    assert set(m["budget"]["runs"]) == {"with_budget", "without_budget"}
    assert m["budget"]["runs"]["with_budget"]["label"] == "with the budget"
    assert set(outage["scenarios"]) == {"memcached_outage"}


def test_asked_for_by_name_without_memcached_it_exits_2_naming_the_install() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sdkcore._demo", "--scenario", NAME],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
        env={**os.environ, "PATH": str(ROOT / "no-such-dir"), "NO_COLOR": "1"},
    )
    assert done.returncode == 2, done.stderr.decode()
    assert done.stdout == b""
    err = done.stderr.decode()
    assert f"--scenario {NAME} needs memcached" in err
    assert INSTALL in err
    assert "Traceback" not in err


def test_asked_for_by_name_with_json_it_exits_2_and_prints_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "memcached" else real(name))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--json", "--scenario", "locked", "--scenario", NAME])
    assert code == 2
    assert out.getvalue() == ""
    assert INSTALL in err.getvalue()


@pytest.mark.parametrize("as_json", [False, True])
def test_the_default_run_without_memcached_skips_it_with_one_line_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    pytest.importorskip("grpc")
    import sdkcore._demo

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "memcached" else real(name))
    # the default run is every scenario: these two stand for them here
    monkeypatch.setattr(sdkcore._demo, "SCENARIO_NAMES", ("locked", NAME))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--json"] if as_json else [])
    assert code == 0, err.getvalue()
    if as_json:
        data = json.loads(out.getvalue())
        assert data["memcached"] == {"skipped": True, "hint": SKIP_LINE, "ok": True}
        assert data["ok"] is True
        assert data["strategies"]["best_effort"]["locked"]["ops"] > 0
    else:
        hints = [line for line in out.getvalue().splitlines() if INSTALL in line]
        assert hints == [SKIP_LINE]
        assert len(SKIP_LINE) <= 100


# -- the launcher and the proxy ----------------------------------------------------------


@pytest.mark.anyio
async def test_memcached_is_killed_when_its_block_fails_or_is_cancelled() -> None:
    binary = memcached_binary()
    server = MemcachedProcess(binary)
    pids: list[int | None] = []

    async def fails() -> None:
        async with server:
            assert server.running
            pids.append(server.pid)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await fails()
    assert not server.running
    assert server.pid is None
    assert pids[0] is not None
    assert not _alive(pids[0])
    server = MemcachedProcess(binary)
    with anyio.move_on_after(0.2):
        async with server:
            pids.append(server.pid)
            await anyio.sleep(30)
    assert not server.running
    assert pids[1] is not None
    assert not _alive(pids[1])


@pytest.mark.anyio
async def test_the_proxy_counts_frames_alive_and_dead() -> None:
    from sdkcore.examples.memcached import MemcachedClient

    binary = memcached_binary()
    async with MemcachedProcess(binary) as server, anyio.create_task_group() as tg:
        proxy = CountingProxy(server.port)
        port = await tg.start(proxy.serve)
        async with MemcachedClient(f"127.0.0.1:{port}", timeout=1.0) as client:
            await client.set("k", b"v")
            assert await client.get("k") == b"v"
            await client.noop()
        assert proxy.snapshot() == {KvOpcode.SET: 1, KvOpcode.GET: 1, KvOpcode.NOOP: 1}
        server.kill()
        with anyio.fail_after(10):  # a safety net
            stream = await anyio.connect_tcp("127.0.0.1", port)
            async with stream:
                from sdkcore.examples.memcached._protocol import noop_frame

                await stream.send(noop_frame(7) + noop_frame(8))
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError, OSError)):
                    await stream.receive()  # counted, unanswered, hung up
        assert proxy.snapshot()[KvOpcode.NOOP] == 3
        assert proxy.refused == 1
        tg.cancel_scope.cancel()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads child processes from /proc")
def test_ctrl_c_during_the_scenario_leaves_no_memcached_behind(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    binary = memcached_binary()
    # A PATH with memcached and nothing else: no setpriv, so no parent-death signal
    # either; only the demo's own cleanup can kill the processes it started.
    (tmp_path / "memcached").symlink_to(binary)
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from sdkcore._demo import main; sys.exit(main(sys.argv[1:]))"
    )  # SIGINT may be ignored where the tests run (a background job): restore Ctrl-C
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--scenario", NAME],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 30  # a safety net
        while not seen and time.monotonic() < deadline and proc.poll() is None:
            seen.update(_memcached_children(proc.pid))
            time.sleep(0.01)
        assert seen, "the scenario started memcached"
        time.sleep(0.05)
        seen.update(_memcached_children(proc.pid))
        proc.send_signal(signal.SIGINT)  # Ctrl-C, to the demo only
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode != 0  # interrupted, not finished
    for pid in seen:
        assert not _alive(pid), f"memcached {pid} outlived the demo"


def _memcached_children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and name == "memcached":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed but not reaped, is not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir()
    return stat[stat.rindex(")") + 2] != "Z"


def test_missing_memcached_skips_locally_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install memcached"):
        memcached_binary()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        memcached_binary()


@pytest.mark.parametrize("verbose", [False, True])
def test_breaker_events_reach_stderr_with_v_only(
    verbose: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    import structlog

    from sdkcore import CircuitBreaker
    from sdkcore._demo import _logging

    structlog.reset_defaults()
    breaker = CircuitBreaker(name="127.0.0.1:1", volume_threshold=1)
    with _logging(verbose):
        breaker.record_failure(TimeoutError("no answer"))  # trips: breaker.opened, a warning
    assert breaker.state.name == "OPEN"
    err = capsys.readouterr().err
    assert ("breaker.opened" in err) is verbose
    assert not structlog.is_configured()


def test_failures_after_the_close_are_named_in_both_reports() -> None:
    from sdkcore._demo._memcached_report import Outage, Transition
    from sdkcore._demo._memcached_text import render_outage
    from sdkcore._demo._report import _wrap

    result = Outage(
        version="1.6",
        endpoints={"A": "127.0.0.1:1", "B": "127.0.0.1:2"},
        transitions=[Transition(0.5, "A", "open", "5 failures in 10 outcomes")],
        killed_at=0.4,
        tripped_at=0.5,
        restarted_at=1.6,
        closed_at=1.7,
        recovered=(40, 38),
        recovered_failures={"timed_out": 2},
        recovered_errors=[
            "issued 3 ms after: AmbiguousTimeoutException: SET timed out",
            "issued 9 ms after: AmbiguousTimeoutException: SET timed out",
        ],
    )
    data = result.to_json()
    assert data["recovered"] == {
        "requests": 40,
        "succeeded": 38,
        "failures": {"timed_out": 2},
        "first_errors": result.recovered_errors,
    }
    assert data["checks"]["requests_succeed_after_restart"] is False
    text = "\n".join(render_outage(result, str, _wrap))
    assert "38 of 40 requests to A succeeded (failed: " in text
    assert text.count("Failed after the close: issued") == 2
    assert "AmbiguousTimeoutException: SET timed out" in text


def test_failures_after_the_close_are_counted_and_the_first_three_quoted() -> None:
    from sdkcore._demo._memcached import tally
    from sdkcore._demo._memcached_report import RECOVERED_ERRORS, Outage

    result = Outage(killed_at=0.4, tripped_at=0.5, restarted_at=1.6, closed_at=1.7)
    late = "AmbiguousTimeoutException: SET timed out"
    done = [
        (0.1, "A", "ok", ""),  # before the kill: counted nowhere but in the total
        (0.45, "A", "timed_out", "UnambiguousTimeoutException: GET timed out"),  # before the trip
        (0.6, "A", "timed_out", "UnambiguousTimeoutException: GET timed out"),  # while open
        (1.65, "A", "ok", ""),  # after the restart, before the close
        (1.70, "A", "ok", ""),
        (1.701, "A", "timed_out", late),
        (1.705, "A", "timed_out", late),
        (1.71, "A", "not_found", "DocumentNotFoundException: key"),
        (1.72, "A", "timed_out", late),
        (1.0, "B", "ok", ""),
        (1.1, "B", "timed_out", late),
    ]
    tally(result, done)
    assert result.outage_outcomes == {"timed_out": 2}
    assert result.requests_while_open == 1
    assert result.recovered == (5, 1)
    assert result.recovered_failures == {"timed_out": 3, "not_found": 1}
    assert len(result.recovered_errors) == RECOVERED_ERRORS == 3
    assert result.recovered_errors[0] == f"issued 1 ms after: {late}"
    assert result.recovered_errors[2] == "issued 10 ms after: DocumentNotFoundException: key"
    assert result.steady == (2, 1)
