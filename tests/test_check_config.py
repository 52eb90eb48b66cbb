"""``sdkcore check-config``: errors with JSON paths, warnings, stdin, and the effective policy."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sdkcore._check_config import lint
from sdkcore._cli import WIDTH, main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # short relative file names in the messages


RETRY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE", 10],
}


def _check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: Any, *extra: str
) -> tuple[int, str, str]:
    path = tmp_path / "service_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    code = main(["check-config", path.name, *extra])
    captured = capsys.readouterr()
    for line in (captured.out + captured.err).splitlines():
        assert len(line) <= WIDTH, line
    return code, captured.out, captured.err


@pytest.mark.parametrize("with_rich", [True, False])
def test_summary_of_the_effective_policy(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    with_rich: bool,
) -> None:
    if with_rich:
        pytest.importorskip("rich")
    else:
        monkeypatch.setitem(sys.modules, "rich", None)
    config = {
        "methodConfig": [
            {
                "name": [{"service": "pkg.Kv", "method": "Get"}, {"service": "pkg.Query"}],
                "retryPolicy": RETRY,
                "timeout": "2.5s",
                "waitForReady": True,
            },
            {
                "name": [{}],
                "hedgingPolicy": {
                    "maxAttempts": 3,
                    "hedgingDelay": "0.05s",
                    "nonFatalStatusCodes": ["UNAVAILABLE"],
                },
            },
        ],
        "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
    }
    code, out, err = _check(tmp_path, capsys, config)
    assert code == 0
    assert err == ""
    assert out.startswith("service_config.json: valid gRPC service config, 2 methodConfigs\n")
    text = " ".join(out.split())  # table cells may wrap
    assert "pkg.Kv/Get, pkg.Query/*" in text
    assert "retry: 4 attempts; backoff 0.1s, x2 per retry, at most 1s (jittered)" in text
    assert "retry on ABORTED, UNAVAILABLE; timeout 2.5s; waitForReady true" in text
    assert "(every method)" in text
    assert "hedging: 3 attempts, 0.05s apart; non-fatal: UNAVAILABLE; no timeout" in text
    assert "retry throttling: maxTokens 10, tokenRatio 0.1" in text
    assert "at or below 5" in text


def test_max_attempts_above_the_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "methodConfig": [{"name": [{"service": "s"}], "retryPolicy": {**RETRY, "maxAttempts": 9}}]
    }
    code, out, err = _check(tmp_path, capsys, config)
    assert code == 0
    assert "retry: 5 attempts (configured 9, cap 5)" in " ".join(out.split())
    assert "methodConfig[0].retryPolicy.maxAttempts: 9 is above the client cap of 5" in err
    code, out, err = _check(tmp_path, capsys, config, "--max-attempts-cap", "10")
    assert code == 0
    assert "retry: 9 attempts;" in out
    assert err == ""


def test_every_violation_with_its_json_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "methodConfig": [
            {
                "name": [{"service": "s"}],
                "retryPolicy": {
                    "maxAttempts": 1,
                    "initialBackoff": "fast",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 0,
                    "retryableStatusCodes": ["SOMETIMES"],
                },
            }
        ],
        "retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1},
    }
    code, out, err = _check(tmp_path, capsys, config)
    assert code == 1
    assert out == ""
    assert err.startswith("service_config.json: invalid gRPC service config (5 problems):\n")
    for path in (
        "methodConfig[0].retryPolicy.maxAttempts: must be an integer >= 2",
        "methodConfig[0].retryPolicy.initialBackoff:",
        "methodConfig[0].retryPolicy.backoffMultiplier: must be a",
        "methodConfig[0].retryPolicy.retryableStatusCodes[0]: must be a valid status code",
        "retryThrottling.maxTokens: must be an integer in (0, 1000]",
    ):
        assert path in err


def test_not_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(tmp_path, capsys, "{methodConfig: []")
    assert code == 1
    assert "(root): must be a JSON object; the text is not JSON" in err
    code, _out, err = _check(tmp_path, capsys, "[]")
    assert code == 1
    assert "(root): must be a JSON object, got an array" in err


def test_warnings_for_likely_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "methodConfig": [
            {
                "name": [{"service": "s", "methd": "Get"}],
                "retryPolicyy": RETRY,
            },
            {"retryPolicy": {**RETRY, "retryableStatusCodes": ["UNAVAILABLE", "OK"]}},
            {"name": [{"service": "t"}], "retryPolicy": {**RETRY, "max_attempts": 3}},
            {"name": [{"service": "u"}], "retryPolicy": {**RETRY, "initialBackoff": "5s"}},
        ],
        "retry_throttling": {"maxTokens": 10, "tokenRatio": 0.1},
    }
    code, out, err = _check(tmp_path, capsys, config)
    assert code == 0  # warnings do not fail the check
    assert "(7 warnings on stderr)" in out
    warnings = [w for w in err.split("warning: ") if w]
    assert len(warnings) == 7, err
    text = " ".join(err.split())
    for expected in (
        "methodConfig[0].name[0].methd: unknown key, ignored; did you mean 'method'?",
        "methodConfig[0].retryPolicyy: unknown key, ignored; did you mean 'retryPolicy'?",
        "methodConfig[1]: no name, so it applies to no method",
        "methodConfig[1].retryPolicy.retryableStatusCodes[1]: OK is not a failure",
        "methodConfig[2].retryPolicy.max_attempts: unknown key, ignored; did you mean "
        "'maxAttempts'? (service config keys are camelCase)",
        "methodConfig[3].retryPolicy.initialBackoff: 5s is above maxBackoff 1s",
    ):
        assert expected in text
    assert "retry_throttling: unknown key, ignored; did you mean 'retryThrottling'?" in text
    assert "retry throttling: off" in out  # the misspelt key is ignored, and the summary says so


def test_retry_throttling_snake_case_is_warned() -> None:
    warnings = lint({"retry_throttling": {}})
    assert warnings == [
        "retry_throttling: unknown key, ignored; did you mean 'retryThrottling'? "
        "(service config keys are camelCase)"
    ]


def test_warnings_are_printed_with_the_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {"methodConfig": [{"name": [{"service": "s"}], "retryPolicy": {"max_attempts": 3}}]}
    code, _out, err = _check(tmp_path, capsys, config)
    assert code == 1
    assert "did you mean 'maxAttempts'?" in err
    assert "methodConfig[0].retryPolicy.maxAttempts: is required" in err


def test_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"methodConfig": [{"name": [{"service": "s"}], "retryPolicy": RETRY}]}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(config)))
    assert main(["check-config", "-"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stdin: valid gRPC service config, 1 methodConfig\n")


def test_missing_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdkcore check-config: error: cannot read ")
    assert "No such file or directory" in err


def test_bad_cap_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(tmp_path, capsys, {}, "--max-attempts-cap", "0")
    assert code == 2
    assert "--max-attempts-cap must be an integer >= 1, got 0" in err


def test_runs_without_grpcio(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"methodConfig": [{"name": [{}], "retryPolicy": RETRY}]}))
    code = (
        "import sys; sys.modules['grpc'] = None; "  # importing grpc now fails
        "from sdkcore._cli import main; sys.exit(main(['check-config', sys.argv[1]]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "valid gRPC service config" in done.stdout


# -- untrusted input: never a traceback, never a raw escape sequence -------------------


def _run_cli(*args: str, stdin: bytes = b"", **env: str) -> subprocess.CompletedProcess[bytes]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "sdkcore", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize("depth", [100, 990, 5000, 100_000])
def test_deeply_nested_json_is_reported_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], depth: int
) -> None:
    nested = "[" * depth + "]" * depth
    for text in (nested, f'{{"methodConfig": {nested}, "x": {nested}}}'):
        code, out, err = _check(tmp_path, capsys, text)
        assert code == 1
        assert out == ""
        assert "invalid gRPC service config" in err


def test_non_utf8_stdin_with_strict_decoding_is_a_clear_error() -> None:
    done = _run_cli(
        "check-config", "-", stdin=b'\xff\xfe{"methodConfig": []}', PYTHONIOENCODING="utf-8"
    )
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "Traceback" not in err
    assert err.startswith(
        "sdkcore check-config: error: stdin is not UTF-8 text: byte 0xff at offset 0"
    )
    assert done.stdout == b""


def test_non_utf8_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes('{"methodConfig": [], "caf\xe9": 1}'.encode("latin-1"))
    assert main(["check-config", path.name]) == 2
    err = capsys.readouterr().err
    assert "latin1.json is not UTF-8 text: byte 0xe9 at offset 25" in err


def test_utf8_bom_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"methodConfig": [{"name": [{"service": "s"}], "retryPolicy": RETRY}]}
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(config).encode())
    assert main(["check-config", path.name]) == 0
    assert capsys.readouterr().out.startswith("bom.json: valid gRPC service config, 1 methodConfig")
    done = _run_cli("check-config", "-", stdin=path.read_bytes(), PYTHONIOENCODING="utf-8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(b"stdin: valid gRPC service config")


@pytest.mark.parametrize("text", ["", "\n", "  \t\n", "\ufeff"])
def test_empty_file_says_it_is_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    code, out, err = _check(tmp_path, capsys, text)
    assert code == 1
    assert out == ""
    assert err.startswith("service_config.json: empty: no gRPC service config to check")


ESCAPES = ["\x1b[31m", "\x1b]0;pwned\x07", "\x9b2J", "\u202e", "\r", "\x00"]


@pytest.mark.parametrize("with_rich", [True, False])
def test_escape_sequences_from_the_file_never_reach_the_terminal(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    with_rich: bool,
) -> None:
    if not with_rich:
        monkeypatch.setitem(sys.modules, "rich", None)
    bad = "".join(ESCAPES)
    valid = {
        f"{bad}key": 1,
        "methodConfig": [{"name": [{"service": f"svc{bad}"}], f"x{bad}": {bad: bad}}],
        "retryThrottling": {f"{bad}t": 1, "maxTokens": 10, "tokenRatio": 0.1},
    }
    invalid = {
        "methodConfig": [
            {"name": [{"service": f"s{bad}", "method": 3}], "retryPolicy": {"maxAttempts": bad}}
        ],
        f"k{bad}": [bad],
    }
    for config in (valid, invalid):
        _code, out, err = _check(tmp_path, capsys, config)
        for stream in (out, err):
            for char in ("\x1b", "\x07", "\x9b", "\u202e", "\r", "\x00"):
                assert char not in stream, (char, stream)
        assert "\\x1b[31m" in out + err  # shown, escaped
    _code, out, err = _check(tmp_path, capsys, valid)
    assert "svc\\x1b[31m" in out
    assert "warning: \\x1b[31m\\x1b]0;pwned\\x07\\x9b2J\\u202e\\x0d\\x00key: unknown key" in err


def test_a_huge_unknown_key_is_shortened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _out, err = _check(tmp_path, capsys, {"k" * 100_000: 1, "methodConfig": []})
    assert code == 0
    assert f"warning: {'k' * 28}...{'k' * 28}: unknown key, ignored" in err
    assert len(err) < 300


def test_an_ascii_terminal_gets_escapes_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps({"methodConfig": [{"name": [{"service": "caf\u00e9"}]}], "\u00e9x": 1}),
        encoding="utf-8",
    )
    done = _run_cli("check-config", str(path), PYTHONIOENCODING="ascii")
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    assert b"caf\\xe9" in done.stdout


def test_max_attempts_beyond_an_int32_is_refused_without_a_treated_as_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = 10**26
    config = {
        "methodConfig": [
            {"name": [{"service": "s"}], "retryPolicy": {**RETRY, "maxAttempts": huge}}
        ]
    }
    code, _, err = _check(tmp_path, capsys, config)
    assert code == 1
    assert "an int32" in err
    assert "treated as" not in err  # refused, not capped


def test_per_attempt_recv_timeout_is_warned_as_ignored() -> None:
    """A valid key of gRPC's retry policy (not A6's) that sdkcore's channels do not apply:
    accepted, and said to be ignored rather than passed silently."""
    policy = {
        "maxAttempts": 3,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
        "perAttemptRecvTimeout": "0.5s",
    }
    warnings = lint({"methodConfig": [{"name": [{}], "retryPolicy": policy}]})
    assert warnings == [
        "methodConfig[0].retryPolicy.perAttemptRecvTimeout: not supported by sdkcore channels, "
        'ignored (an attempt ends with the call\'s timeout); see rfc/0003, "Not done here"'
    ]
    del policy["perAttemptRecvTimeout"]
    assert lint({"methodConfig": [{"name": [{}], "retryPolicy": policy}]}) == []


def _hedged(delay: str | None, timeout: str | None) -> dict[str, object]:
    hedging: dict[str, object] = {"maxAttempts": 3, "nonFatalStatusCodes": ["UNAVAILABLE"]}
    if delay is not None:
        hedging["hedgingDelay"] = delay
    mc: dict[str, object] = {"name": [{"service": "s"}], "hedgingPolicy": hedging}
    if timeout is not None:
        mc["timeout"] = timeout
    return {"methodConfig": [mc]}


@pytest.mark.parametrize(("delay", "timeout"), [("2s", "1s"), ("1s", "1s"), ("1.5s", "1.000s")])
def test_a_hedging_delay_at_or_past_the_timeout_is_warned(delay: str, timeout: str) -> None:
    """hedgingDelay >= the method's timeout: the call's deadline comes before any hedge, so
    the hedgingPolicy sends only the first copy (a typo of units, or a timeout cut later)."""
    assert lint(_hedged(delay, timeout)) == [
        f"methodConfig[0].hedgingPolicy.hedgingDelay: {delay} is not below the method's "
        f"timeout {timeout}: the call's deadline comes first, so no hedge is ever sent"
    ]


@pytest.mark.parametrize(
    ("delay", "timeout"),
    [("0.5s", "1s"), (None, "1s"), ("2s", None), ("2s", "0s"), ("soon", "1s"), ("2s", 1)],
    ids=["below", "no-delay", "no-timeout", "timeout-0s-is-none", "bad-delay", "bad-timeout"],
)
def test_a_hedging_delay_below_the_timeout_is_not_warned(
    delay: str | None, timeout: str | None
) -> None:
    """Below the timeout, without one ("0s" is none, as grpc reads it), or a value the
    parser refuses (an error of its own, not a warning as well)."""
    assert lint(_hedged(delay, timeout)) == []


def test_the_hedging_warning_is_printed_by_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _check(tmp_path, capsys, _hedged("5s", "2s"))
    assert code == 0
    assert "(1 warning on stderr)" in out
    assert "hedgingDelay: 5s is not below the method's timeout 2s" in " ".join(err.split())
