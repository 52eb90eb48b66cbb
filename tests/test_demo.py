"""``sdkcore demo``: its numbers, its checks, and how it behaves as a command.

The demo's server is real (grpc.aio on 127.0.0.1); the runs here pick a few short
scenarios so the whole file takes seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from stderr_kit import tracebacks

from sdkcore._demo import SCENARIO_NAMES, main

ROOT = Path(__file__).resolve().parent.parent
# the strategies' keys in --json (the text report shows their labels)
BEST_EFFORT = "best_effort"
FAST_FAIL = "fast_fail_on_terminal_error"
USER = "give_up_after_six"
LABELS = {
    BEST_EFFORT: "BestEffort",
    FAST_FAIL: "FastFailOnTerminalError (default)",
    USER: "GiveUpAfterSix (user strategy)",
}


def _run_json(*args: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--json", *args])
    data: dict[str, Any] = json.loads(out.getvalue())  # stdout holds the JSON and nothing else
    data["_exit_code"] = code
    data["_stderr"] = err.getvalue()
    return data


def example_of(data: dict[str, Any], exception: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [e for e in data["examples"] if e["exception"] == exception]
    assert len(found) == 1, data["examples"]
    return found[0]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    pytest.importorskip("grpc")
    return _run_json(
        "--scenario",
        "bad-credentials",
        "--scenario",
        "node-restart",
        "--scenario",
        "slow-replica",
        "--scenario",
        "hedged-reads",
    )


def test_fast_fail_ends_bad_credentials_at_once_while_best_effort_times_out(
    results: dict[str, Any],
) -> None:
    from sdkcore._demo._workload import OP_TIMEOUT

    timeout_ms = OP_TIMEOUT * 1000
    fast = results["strategies"][FAST_FAIL]["bad_credentials"]
    assert fast["fast_fails"] == {"AuthenticationFailureException": fast["ops"]}
    assert fast["successes"] == 0
    assert fast["timeouts"] == {"ambiguous": 0, "unambiguous": 0}
    assert fast["retries_per_op"] == 0
    # well under the timeout (it takes a few ms; the bound is loose for busy machines)
    assert fast["p99_ms"] < timeout_ms / 2

    best = results["strategies"][BEST_EFFORT]["bad_credentials"]
    assert best["fast_fails"] == {}
    # reads and writes alike: the credentials were refused before anything was applied
    assert best["timeouts"] == {"ambiguous": 0, "unambiguous": best["ops"]}
    assert best["retries_per_op"] > 1
    assert best["p50_ms"] >= timeout_ms * 0.95  # each waited for its timeout
    assert best["retry_reasons"] == ["AUTHENTICATION_ERROR"]

    user = results["strategies"][USER]["bad_credentials"]
    assert user["fast_fails"] == {"RequestCanceledException": user["ops"]}
    assert user["retries_per_op"] == 6

    example = example_of(results, "AuthenticationFailureException")["message"]
    assert '"reason": "AUTHENTICATION_ERROR"' in example


def test_a_call_the_channel_retried_reports_the_channels_attempts() -> None:
    """overload: RESOURCE_EXHAUSTED is retried by the channel's retryPolicy (pushback
    honoured), then ends the request as RateLimitedException. Its context counts the
    orchestrator's retries (none: the mapped exception is final), and ``extra`` the
    channel's attempts, which an operator would otherwise not see."""
    pytest.importorskip("grpc")
    from sdkcore._demo._workload import _METHOD_CONFIGS

    most = max(mc["retryPolicy"]["maxAttempts"] for mc in _METHOD_CONFIGS)
    data = _run_json("--scenario", "overload")
    message = example_of(data, "RateLimitedException")["message"]
    context = json.loads(message[message.index(" {") + 1 :])
    assert context["retry_attempts"] == 0
    attempts = context["extra"]["grpc_attempts"]
    assert 2 <= attempts <= most


SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
#: Maps whose keys are the library's own names (exception classes, opcodes), verbatim.
VERBATIM = frozenset({"fast_fails", "errors", "frames_before_trip", "frames_after_trip"})


def not_snake_keys(doc: Any, path: str = "") -> list[str]:
    """The paths of every key in ``doc`` that is not a snake_case identifier."""
    bad: list[str] = []
    if isinstance(doc, dict):
        verbatim = path.rsplit(".", 1)[-1] in VERBATIM
        for key, value in doc.items():
            if not verbatim and not SNAKE.fullmatch(key):
                bad.append(f"{path}.{key}")
            bad += not_snake_keys(value, f"{path}.{key}")
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            bad += not_snake_keys(value, f"{path}[{i}]")
    return bad


def test_json_keys_are_snake_case_identifiers(results: dict[str, Any]) -> None:
    doc = {k: v for k, v in results.items() if not k.startswith("_")}
    assert not_snake_keys(doc) == []
    assert set(doc["strategies"]) == {BEST_EFFORT, FAST_FAIL, USER}
    assert doc["strategy_labels"] == LABELS
    assert doc["scenarios"]["bad_credentials"]["name"] == "bad-credentials"  # --scenario's
    assert set(doc["strategies"][BEST_EFFORT]) == {
        "bad_credentials", "node_restart", "slow_replica", "hedged_reads", "all",
    }  # fmt: skip
    for example in doc["examples"]:
        assert example["scenario"] in doc["scenarios"]
        assert example["strategy"] in doc["strategies"]


def test_no_write_is_applied_twice(results: dict[str, Any]) -> None:
    writes = results["writes"]
    assert writes["duplicates"] == []
    assert results["ok"] is True
    assert results["_exit_code"] == 0
    # Each node-restart run loses the reply of writes the server applied: the client
    # got an error for each, and none was applied again.
    assert writes["applied"] - writes["succeeded"] >= 2 * 3
    for strategy in (BEST_EFFORT, FAST_FAIL, USER):
        restart = results["strategies"][strategy]["node_restart"]
        assert "SOCKET_CLOSED_WHILE_IN_FLIGHT" in restart["retry_reasons"]
        assert restart["fast_fails"].get("RequestCanceledException", 0) >= 2
        assert restart["channel_retries"] > 0  # reads retried by the channel's retryPolicy
    # The example refusal: a write that may have reached the server is not sent again
    # (SOCKET_CLOSED_WHILE_IN_FLIGHT by its flag, or an answered UNAVAILABLE by its effect).
    refusal = example_of(results, "RequestCanceledException")["message"]
    assert "not idempotent" in refusal
    assert "SOCKET_CLOSED_WHILE_IN_FLIGHT" in refusal or "MAYBE_APPLIED" in refusal


def test_the_duplicate_write_check_can_fail() -> None:
    pytest.importorskip("grpc")
    from sdkcore._demo._server import TroubledCluster

    cluster = TroubledCluster()
    cluster._apply({"key": "k", "op": "1"})
    cluster._apply({"key": "k", "op": "2"})
    assert cluster.duplicate_writes() == []
    cluster._apply({"key": "k", "op": "1"})
    assert cluster.duplicate_writes() == [("k", "1", 2)]


def test_hedged_reads_cut_the_slow_replica_tail(results: dict[str, Any]) -> None:
    from sdkcore._demo._server import SLOW_SECONDS

    plain = results["strategies"][BEST_EFFORT]["slow_replica"]
    assert plain["successes"] == plain["ops"]
    for strategy in (BEST_EFFORT, FAST_FAIL, USER):
        plain = results["strategies"][strategy]["slow_replica"]
        hedged = results["strategies"][strategy]["hedged_reads"]
        assert hedged["successes"] == hedged["ops"]
        # 1 read in 7 takes 300 ms on replica 0; a hedge to replica 1 goes after 20 ms
        # (it takes ~30 ms; the bound leaves room for a busy machine)
        assert plain["p99_ms"] >= SLOW_SECONDS * 1000
        assert hedged["p99_ms"] < plain["p99_ms"] * 0.75
        # the channel's hedgingPolicy and the generic runner sent hedges: not retries
        assert hedged["hedges"] > 0
        assert hedged["channel_retries"] == 0
        assert hedged["retries_per_op"] == 0


def test_text_report_fits_100_columns_without_colour(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("grpc")
    assert main(["--scenario", "locked"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "\x1b[" not in out  # not a terminal: no colour
    for label in LABELS.values():
        assert f"Strategy: {label}" in out
    assert "OK: no write was applied twice." in out
    assert "Legend" in out
    assert "KV_LOCKED" in out
    assert "internal" not in out.lower()


def test_piped_output_survives_a_closed_pipe() -> None:
    pytest.importorskip("grpc")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdkcore._demo", "--scenario", "locked"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert proc.stdout is not None
    proc.stdout.close()  # like `| head -0`: the reader is gone before anything is written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert not tracebacks(err), err.decode()
    assert b"BrokenPipeError" not in err


def test_piped_into_head() -> None:
    pytest.importorskip("grpc")
    done = subprocess.run(
        f"{sys.executable} -m sdkcore._demo --scenario locked | head -2",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert len(done.stdout.decode().splitlines()) == 2
    assert not tracebacks(done.stderr), done.stderr.decode()


def test_piped_report_streams_the_head_before_the_run_ends() -> None:
    """`sdkcore demo | head`: the head and scenario list at once, then a line per scenario."""
    pytest.importorskip("grpc")
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "sdkcore._demo"],  # every scenario: several seconds
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert proc.stdout is not None
    try:
        started = time.monotonic()
        first = proc.stdout.readline().decode()
        assert first.startswith("sdkcore demo: ")
        assert proc.poll() is None  # the run is still going
        lines = [proc.stdout.readline().decode() for _ in range(len(SCENARIO_NAMES) + 6)]
        assert lines[1] == "Scenarios\n"
        assert lines[-1].startswith("rebalance ")  # the first scenario's line, as it ended
        assert proc.poll() is None  # ... while the others still run
        assert time.monotonic() - started < 30
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()


def test_streamed_lines_are_the_text_report() -> None:
    """What run() emits as it goes, then the tail, is render_text of its report, line for line."""
    pytest.importorskip("grpc")
    import asyncio

    from sdkcore._demo._report import render_tail, render_text
    from sdkcore._demo._run import run

    emitted: list[list[str]] = []
    report = asyncio.run(run(["locked", "bad-credentials"], progress=False, emit=emitted.append))
    assert emitted[0][0].startswith("sdkcore demo: ")  # the head came first
    assert len(emitted) == 1 + 3 * (1 + 2 + 1)  # head; per strategy: heading, 2 rows, all
    streamed = [line for chunk in emitted for line in chunk]
    assert streamed + render_tail(report) == render_text(report)


def test_verbose_streams_log_events_to_stderr_and_restores_structlog() -> None:
    pytest.importorskip("grpc")
    structlog.reset_defaults()
    data = _run_json("-v", "--scenario", "locked")
    assert "retry.scheduled" in data["_stderr"]
    assert "KV_LOCKED" in data["_stderr"]
    assert not structlog.is_configured()


@pytest.mark.usefixtures("no_gc_pauses")  # the demo's lock lasts 0.3 s of real time
def test_locked_document_quiet_by_default() -> None:
    pytest.importorskip("grpc")
    data = _run_json("--scenario", "locked")
    assert "retry.scheduled" not in data["_stderr"]
    assert set(data["strategies"]) == {BEST_EFFORT, FAST_FAIL, USER}
    # The lock outlasts six short backoffs but not the timeout: best effort writes
    # get through; the user strategy gives some up.
    best = data["strategies"][BEST_EFFORT]["locked"]
    assert best["successes"] == best["ops"]
    assert best["retry_reasons"] == ["KV_LOCKED"]
    user = data["strategies"][USER]["locked"]
    assert user["fast_fails"].get("RequestCanceledException", 0) > 0
    assert data["writes"]["duplicates"] == []


def test_help_lists_the_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SCENARIO_NAMES:
        assert name in out


def test_unknown_scenario_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--scenario", "nope"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_without_grpcio_it_names_the_extra_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "grpc", None)  # `import grpc` raises ImportError
    assert main(["--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "pip install grpcio" in captured.err
    assert "pip install 'sdkcore" not in captured.err  # sdkcore is not on PyPI


def test_scenario_names_match_the_workload() -> None:
    pytest.importorskip("grpc")
    from sdkcore._demo._memcached_report import NAME
    from sdkcore._demo._slowdown import NAME as SLOWDOWN
    from sdkcore._demo._workload import SCENARIOS

    # the gRPC cluster's scenarios, the in-process slow endpoint, then the one on a real memcached
    assert (*(s.name for s in SCENARIOS), SLOWDOWN, NAME) == SCENARIO_NAMES


def test_a_failure_outside_sdkcore_exceptions_fails_the_run() -> None:
    pytest.importorskip("grpc")
    from sdkcore._demo._report import Report, render_text, summarize, to_json
    from sdkcore._demo._workload import OpResult

    bug = OpResult(False, False, 0.001, 0, (), error="TypeError", message="boom", unexpected=True)
    fine = OpResult(True, True, 0.002, 1, ("KV_LOCKED",))
    summary = summarize([bug, fine], channel_retries=0)
    assert summary.errors == {"TypeError": 1}
    assert summary.fast_fails == {}
    report = Report(target="127.0.0.1:1", tables={"BestEffort": {"x": summary, "all": summary}})
    assert not report.ok
    assert to_json(report)["ok"] is False
    text = "\n".join(render_text(report))
    assert "NOT sdkcore exceptions (a bug): TypeError x1" in text
    assert "FAILED: 1 operations failed" in text


def test_ctrl_c_ends_the_run_with_one_line_and_130() -> None:
    pytest.importorskip("grpc")
    import signal

    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sdkcore._demo",
            "--scenario",
            "locked",
            "--scenario",
            "bad-credentials",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert run.stdout is not None
    run.stdout.readline()  # the head: streamed from inside the run, which lasts seconds more
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=30)
    assert run.returncode == 130
    assert not tracebacks(err), err
    assert err.strip().splitlines()[-1] == "sdkcore demo: interrupted"


@pytest.mark.parametrize(
    ("applied", "succeeded", "duplicates", "says", "never_says"),
    [
        (6, 5, [], "1 was applied but its reply was lost", "1 were"),
        (8, 5, [], "3 were applied but their replies were lost", "applied already"),
        (
            6,
            5,
            [("airline_10", "op-3", 2)],
            "6 writes (1 of them a write it had applied already); 5 returned success",
            "none was applied again",
        ),
    ],
)
def test_the_writes_line_tells_lost_replies_from_writes_applied_twice(
    applied: int, succeeded: int, duplicates: list[Any], says: str, never_says: str
) -> None:
    """The line blamed every write applied beyond the successes on a lost reply "the client
    did not send again", also when one was a write applied twice, right above the line
    saying FAILED for it (an operator's review); and said "1 were". It claims only what
    the server's count shows: none was applied again (a resend it refused is not seen)."""
    from sdkcore._demo._report import Report, Summary, render_tail

    summary = Summary(
        ops=10,
        successes=10,
        fast_fails={},
        ambiguous_timeouts=0,
        unambiguous_timeouts=0,
        retries_per_op=0.0,
        p50_ms=1.0,
        p99_ms=2.0,
        retry_reasons=(),
        channel_retries=0,
        errors={},
        hedges=0,
    )
    report = Report(
        target="127.0.0.1:1",
        tables={"BestEffort": {"locked": summary, "all": summary}},
        writes_applied=applied,
        writes_succeeded=succeeded,
        duplicate_writes=duplicates,
    )
    text = " ".join(" ".join(render_tail(report)).split())  # unwrapped
    assert says in text
    assert never_says not in text


@pytest.mark.usefixtures("no_gc_pauses")
def test_the_slowdown_scenarios_limiter_warnings_wait_for_verbose() -> None:
    """The limiter refusing is the slowdown scenario's story, told in its report: a default
    run printed its limiter.refusing warning among the progress bar (an operator's
    review), as the breaker's warnings were kept for -v already."""
    pytest.importorskip("grpc")
    quiet = _run_json("--scenario", "slowdown")
    assert "limiter." not in quiet["_stderr"]
    loud = _run_json("-v", "--scenario", "slowdown")
    assert "limiter.refusing" in loud["_stderr"]  # the event the default run holds back
