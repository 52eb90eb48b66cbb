"""The ``sdkcore demo`` command: runs, and reports what each strategy did."""

from __future__ import annotations

import re

import pytest
import structlog

from sdkcore._cli import main


def _rows(out: str, section: str) -> dict[str, str]:
    """The strategy -> outcome rows under the scenario heading that contains ``section``."""
    block = out.split("== ")
    text = next(b for b in block if section in b.splitlines()[0])
    rows = {}
    for line in text.splitlines()[1:]:
        m = re.match(r"\s+(.+?)\s+-> (\S+)", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_demo_reports_each_strategy(capsys: pytest.CaptureFixture[str], backend: str) -> None:
    assert main(["demo", "--quiet", "--backend", backend]) == 0
    out = capsys.readouterr().out

    nmvb = _rows(out, "NOT_MY_VBUCKET twice")
    assert set(nmvb.values()) == {"ok"}, nmvb  # always-retry, even under FailFast
    assert len(nmvb) == 4

    upsert = _rows(out, "upsert: socket closed")
    assert set(upsert.values()) == {"RequestCanceledException"}  # never sent twice

    auth = _rows(out, "AUTHENTICATION_ERROR")
    assert auth["FastFailOnTerminalError (default)"] == "AuthenticationFailureException"
    assert auth["BestEffort"] == "UnambiguousTimeoutException"

    robot = _rows(out, "robot")
    assert robot["NoRobots (BestEffort subclass)"] == "RequestCanceledException"
    assert robot["BestEffort"] == "ok"


def test_demo_prints_log_events(capsys: pytest.CaptureFixture[str]) -> None:
    structlog.configure(processors=[structlog.processors.KeyValueRenderer()])
    before = structlog.get_config()
    try:
        assert main(["demo"]) == 0
        after = structlog.get_config()
    finally:
        structlog.reset_defaults()
    out = capsys.readouterr().out
    assert "retry.scheduled" in out
    assert "retry.not_retried" in out
    assert "retry.timed_out" in out
    # the demo is an application, but when called as a function it restores the
    # configuration it found
    assert after == before


def test_unknown_command_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["nope"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_leaves_an_unconfigured_structlog_unconfigured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    structlog.reset_defaults()
    assert main(["demo", "--quiet"]) == 0
    capsys.readouterr()
    assert not structlog.is_configured()
