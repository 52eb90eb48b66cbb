"""``sdkcore explain``: each kind of input, what the real strategies decide, and bad input."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
import structlog

import sdkcore
from sdkcore import AttemptEffect, RetryReason
from sdkcore._cli import WIDTH, main
from sdkcore._explain import explain_outcomes, explain_reason

BEST_EFFORT = "BestEffortRetryStrategy"
FAST_FAIL = "FastFailOnTerminalErrorRetryStrategy"


@pytest.fixture(params=["plain", "rich"])
def output(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test with the plain-text output and, when installed, with rich."""
    if request.param == "plain":
        monkeypatch.setitem(sys.modules, "rich", None)
    else:
        pytest.importorskip("rich")
    return str(request.param)


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["explain", *args]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    return captured.out


def _rows(out: str) -> dict[tuple[str, str], str]:
    """(strategy, request kind) -> outcome, from the strategy table (wrapped cells joined)."""
    rows: dict[tuple[str, str], str] = {}
    last: tuple[str, str] | None = None
    pattern = r"\s+([A-Za-z_]+RetryStrategy)\s+(idempotent|non-idempotent)\s+"
    for line in out.split("What each strategy does", 1)[1].splitlines()[2:]:
        m = re.match(pattern + r"(.*)", line)
        if m:
            last = (m.group(1), m.group(2))
            rows[last] = m.group(3).strip()
        elif last is not None and line.startswith(" " * 40) and line.strip():
            rows[last] += " " + line.strip()
        else:
            last = None
    return rows


def test_kv_not_my_vbucket_is_always_retried_with_controlled_backoff(
    output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _explain(capsys, "kv", "0x07", "--opcode", "get")
    assert "KV status 0x07 NOT_MY_VBUCKET on GET (0x00)" in out
    assert "retry reason KV_NOT_MY_VBUCKET" in out
    assert "kv_failure" in out
    assert re.search(r"always_retry\s+yes", out)
    rows = _rows(out)
    assert len(rows) == 4
    # the strategy is not consulted: non-idempotent requests retried too (NOT_APPLIED)
    assert set(rows.values()) == {"retry after 1, 10, 50, 100, 500 ms, ..."}


def test_kv_status_by_name_and_a_non_retryable_status(capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "kv", "locked", "--opcode", "UNLOCK")
    assert "0x09 LOCKED on UNLOCK (0x95)" in out
    assert "CasMismatchException" in out  # RFC 0049: LOCKED on UNLOCK is never retried
    assert "Not a retry reason" in out
    out = _explain(capsys, "kv", "1")
    assert "DocumentNotFoundException" in out
    assert "(the opcode is idempotent: RFC 0049 list)" in out
    out = _explain(capsys, "kv", "0x07", "--opcode", "upsert")
    assert "on SET (0x01) -> retry reason KV_NOT_MY_VBUCKET" in out
    assert "(the opcode is not idempotent: RFC 0049 list)" in out


def test_query_prepared_statement_failure(output: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "query", "4050")
    assert "query error 4050 -> retry reason QUERY_PREPARED_STATEMENT_FAILURE" in out
    rows = _rows(out)
    assert rows[(BEST_EFFORT, "idempotent")] == "retry after 1, 2, 4, 8, 16 ms, ..."
    assert rows[(BEST_EFFORT, "non-idempotent")] == "retry after 1, 2, 4, 8, 16 ms, ..."
    assert rows[(FAST_FAIL, "idempotent")] == "retry after 1, 2, 4, 8, 16 ms, ..."


def test_query_code_that_is_no_retry_reason(capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "query", "1234")
    assert "not a retry reason (sdkcore.mapping.query_retry_reason returns None)" in out
    out = _explain(capsys, "query", "1234", "--retry")
    assert "QUERY_ERROR_RETRYABLE" in out


def test_views_302(capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "views", "302")
    assert "retry reason VIEWS_NO_ACTIVE_PARTITION" in out
    assert set(_rows(out).values()) == {"retry after 1, 10, 50, 100, 500 ms, ..."}


def test_grpc_unavailable_and_not_found(output: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "grpc", "UNAVAILABLE")
    assert "gRPC status UNAVAILABLE (14) -> retry reason SERVICE_NOT_AVAILABLE" in out
    assert re.search(r"after_dispatch\s+no", out)
    # One claim on the screen: a status from a server may have been applied.
    found = re.search(r"^\s*attempt effect\s+([A-Z_]+)\s", out, re.MULTILINE)
    assert found is not None
    assert found.group(1) == "MAYBE_APPLIED"
    flat = " ".join(out.split())
    assert "NOT_SENT" not in flat
    assert "unambiguous" not in flat
    assert "never left the client; this answer came from the server" in flat
    assert "did not change server state" not in flat
    out = _explain(capsys, "grpc", "5")
    assert "DocumentNotFoundException" in out
    out = _explain(capsys, "grpc", "DEADLINE_EXCEEDED", "--read-only")
    assert "UnambiguousTimeoutException" in out


def test_reason_kv_locked(output: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "reason", "KV_LOCKED")
    assert out.startswith("RetryReason KV_LOCKED\n")
    assert re.search(r"allows_non_idempotent_retry\s+yes", out)
    assert re.search(r"always_retry\s+no", out)
    rows = _rows(out)
    assert rows[(FAST_FAIL, "non-idempotent")] == ("retry after 1, 2, 4, 8, 16 ms, ...")


def test_reason_terminal_and_in_flight(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(_explain(capsys, "reason", "authentication_error"))
    assert rows[(FAST_FAIL, "idempotent")] == (
        "fails: AuthenticationFailureException (NO_MORE_RETRIES)"
    )
    assert rows[(BEST_EFFORT, "idempotent")] == "retry after 1, 2, 4, 8, 16 ms, ..."
    rows = _rows(_explain(capsys, "reason", "SOCKET_CLOSED_WHILE_IN_FLIGHT"))
    assert rows[(BEST_EFFORT, "idempotent")] == "retry after 1, 2, 4, 8, 16 ms, ..."
    assert rows[(BEST_EFFORT, "non-idempotent")].startswith("fails: RequestCanceledException")


def test_analytics_and_search(capsys: pytest.CaptureFixture[str]) -> None:
    assert "ANALYTICS_TEMPORARY_FAILURE" in _explain(capsys, "analytics", "23000")
    assert "not a retry reason" in _explain(capsys, "analytics", "24045")
    assert "SEARCH_TOO_MANY_REQUESTS" in _explain(capsys, "search", "429")
    out = _explain(capsys, "search", "429", "--body", "num_queries_per_min exceeded")
    assert "RateLimitedException" in out


def test_explain_reason_drives_the_strategies() -> None:
    rows = {(s, k): o for s, k, o in explain_reason(RetryReason.TLS_ERROR)}
    assert rows[(FAST_FAIL, "idempotent")] == "fails: CouchbaseException (NO_MORE_RETRIES)"
    assert rows[(BEST_EFFORT, "non-idempotent")] == "retry after 1, 2, 4, 8, 16 ms, ..."


def test_no_log_lines_leak_into_the_output(capsys: pytest.CaptureFixture[str]) -> None:
    structlog.reset_defaults()  # unconfigured structlog prints every event to stdout
    out = _explain(capsys, "reason", "KV_TEMPORARY_FAILURE")
    assert "retry.scheduled" not in out
    assert not structlog.is_configured()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["kv", "zz"], "kv: unknown status 'zz'; expected a number (0x07, 7) or one of:"),
        (["kv", "0x10000"], "kv: status '0x10000' is out of range"),
        (["kv", "0"], "SUCCESS, not a failure"),
        (["kv", "SUCCESS"], "kv: status 0x00 is SUCCESS, not a failure"),
        (["kv", "success"], "kv: status 0x00 is SUCCESS, not a failure"),
        (["kv", "-1"], "kv: status '-1' is out of range; expected 0..0xffff"),
        (["kv", "7", "--opcode", "-1"], "kv --opcode '-1' is out of range; expected 0..0xff"),
        (["query", "-5"], "query: error code '-5' is out of range; expected 1..99999"),
        (["query", "0"], "query: error code '0' is out of range; expected 1..99999"),
        (["analytics", "-23000"], "analytics: error code '-23000' is out of range"),
        (["analytics", "1" + "0" * 5000], "analytics: error code '1000"),
        # over 32 characters with a sign: read as 0 ("SUCCESS, not a failure") before
        (["kv", "-" + "9" * 40], "kv: status '-9999"),
        (["kv", "+" + "9" * 40], "kv: status '+9999"),
        (["grpc", "+" + "9" * 40], "grpc: status code '+9999"),
        (["kv", "+" + "9" * 31 + "x" * 9], "kv: unknown status '+9999"),
        (["views", "200"], "views: HTTP 200 is a success, not a failure"),
        (["search", "200"], "search: HTTP 200 is a success, not a failure"),
        (["search", "204"], "search: HTTP 204 is a success, not a failure"),
        (["grpc", "-1"], "grpc: status code '-1' is out of range; expected 0..16"),
        (["grpc", "17"], "grpc: status code '17' is out of range; expected 0..16"),
        (["grpc", "0"], "grpc: OK is not a failure"),
        (["kv", "\x1b[31mx"], "kv: unknown status '\\x1b[31mx'"),
        (["kv", "7", "--opcode", "fly"], "kv --opcode: unknown opcode 'fly'"),
        (["query", "x"], "query: 'x' is not a number; expected an error code 1..99999"),
        (["views", "42"], "views: '42' is not an HTTP status; expected 100..599"),
        (["search", "abc"], "search: 'abc' is not a number"),
        (["grpc", "SOMETIMES"], "grpc: unknown status code 'SOMETIMES'; a number 0..16 or one of:"),
        (["grpc", "OK"], "grpc: OK is not a failure"),
        (["reason", "NOPE"], "reason: unknown retry reason 'NOPE'; one of:"),
    ],
)
def test_bad_input_exits_2_with_what_is_accepted(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["explain", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("sdkcore explain: error: ")
    assert message in " ".join(captured.err.split())
    assert all(len(line) <= WIDTH for line in captured.err.splitlines())
    assert "Traceback" not in captured.err
    assert "\x1b" not in captured.err  # an escape sequence is shown escaped, never sent
    assert len(captured.err) < 4000  # a huge input is shown shortened


def test_unknown_kind_exits_2_listing_the_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["explain", "disk", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for kind in ("kv", "query", "analytics", "search", "views", "grpc", "reason"):
        assert f"'{kind}'" in err


def test_explain_shows_the_attempt_effect() -> None:
    """What a failure means for a later timeout (rfc/0001 "Ambiguity")."""
    import contextlib
    import io

    from sdkcore._cli import main

    cases = {
        ("reason", "KV_LOCKED"): "NOT_APPLIED",
        ("reason", "SOCKET_CLOSED_WHILE_IN_FLIGHT"): "MAYBE_APPLIED",
        ("reason", "SOCKET_NOT_AVAILABLE"): "NOT_SENT",
    }
    for args, effect in cases.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["explain", *args]) == 0
        found = re.search(r"^\s*attempt effect\s+([A-Z_]+)\s", buf.getvalue(), re.MULTILINE)
        assert found is not None
        assert found.group(1) == effect, args


def test_http_answers_that_are_not_errors_are_not_called_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for kind, status in (("views", "304"), ("search", "302"), ("views", "100")):
        out = _explain(capsys, kind, status)
        assert "not a retry reason" in out
        assert "own error" not in out
        assert "completes it with what the service answered" in " ".join(out.split())


def test_every_numeric_input_gets_an_answer_or_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A sweep over each kind's values around its range: exit 0 or 2, never a traceback."""
    values = ["-1", "0", "1", "7", "0x07", "16", "17", "99", "100", "200", "429", "599", "600"]
    values += ["99999", "100000", "65535", "65536", "1e3", "", " ", "0b1", "1_0"]
    for kind in ("kv", "query", "analytics", "search", "views", "grpc"):
        for value in values:
            code = main(["explain", kind, value])
            captured = capsys.readouterr()
            assert code in (0, 2), (kind, value)
            if code == 2:
                assert captured.err.startswith("sdkcore explain: error: "), (kind, value)
                assert captured.out == ""
            else:
                assert captured.out, (kind, value)
                assert captured.err == "", (kind, value)


# -- issue 21, item 7: every column labelled, only exported strategies, JSON keys ----------


def _header(out: str, first: str) -> list[str]:
    """The header cells of the table whose first column is ``first`` (rich or plain)."""
    for line in out.splitlines():
        cells = line.split()
        if cells[:1] == [first]:
            return cells
    raise AssertionError(f"no table headed {first!r} in:\n{out}")


@pytest.mark.parametrize(
    "args",
    [("reason", "KV_LOCKED"), ("grpc", "UNAVAILABLE"), ("kv", "7", "--opcode", "upsert")],
)
def test_every_column_has_a_header(
    output: str, capsys: pytest.CaptureFixture[str], args: tuple[str, ...]
) -> None:
    """The flags table's middle column used to have no header ("flag", "", "meaning")."""
    out = _explain(capsys, *args)
    assert _header(out, "property") == ["property", "value", "meaning"]
    assert _header(out, "strategy") == ["strategy", "request", "outcome"]
    # each header sits above its column: the value cells start where "value" starts
    lines = out.splitlines()
    head = next(line for line in lines if line.split()[:1] == ["property"])
    row = next(line for line in lines if line.split()[:1] == ["always_retry"])
    value = re.match(r"\s*always_retry\s+", row)
    assert value is not None
    assert value.end() == head.index("value")


def test_only_exported_strategies_are_named(
    output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    exported = {name for name in sdkcore.__all__ if name.endswith("RetryStrategy")}
    assert exported == {BEST_EFFORT, FAST_FAIL, "RetryStrategy"}
    for args in (("reason", "KV_LOCKED"), ("grpc", "UNAVAILABLE"), ("query", "4050")):
        out = _explain(capsys, *args)
        named = {s for s, _ in _rows(out)}
        assert named == {BEST_EFFORT, FAST_FAIL}, args
        assert "FailFast" not in out  # FailFastRetryStrategy is internal
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    help_text = capsys.readouterr().out
    assert "FailFast" not in help_text
    assert BEST_EFFORT in " ".join(help_text.split())
    assert {o.strategy for o in explain_outcomes(RetryReason.KV_LOCKED)} <= set(sdkcore.__all__)


def _keys(data: Any) -> set[str]:
    if isinstance(data, dict):
        return set(data) | {k for v in data.values() for k in _keys(v)}
    if isinstance(data, list):
        return {k for v in data for k in _keys(v)}
    return set()


@pytest.mark.parametrize(
    "args",
    [
        ("reason", "KV_LOCKED"),
        ("grpc", "UNAVAILABLE"),
        ("grpc", "5"),
        ("kv", "1"),
        ("kv", "7", "--opcode", "upsert"),
        ("query", "1234"),
        ("search", "429", "--body", "num_queries_per_min"),
    ],
)
def test_json_keys_are_snake_case_identifiers(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...]
) -> None:
    assert main(["explain", *args, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    data = json.loads(captured.out)
    keys = _keys(data)
    assert keys, data
    assert all(re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", k) for k in keys), sorted(keys)
    assert {"kind", "value", "answer", "mapped_by", "retry_reason", "exception"} <= set(data)
    if data["retry_reason"] is not None:
        assert {o["strategy"] for o in data["outcomes"]} == {BEST_EFFORT, FAST_FAIL}
        assert set(data["flags"]) == {
            "allows_non_idempotent_retry",
            "always_retry",
            "after_dispatch",
        }


def test_json_outcomes_match_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "reason", "AUTHENTICATION_ERROR", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by = {(o["strategy"], o["idempotent"]): o for o in data["outcomes"]}
    assert by[(BEST_EFFORT, True)]["delays_ms"] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert by[(BEST_EFFORT, True)]["retries_go_on"] is True
    fast = by[(FAST_FAIL, True)]
    assert fast["exception"] == "AuthenticationFailureException"
    assert fast["cancellation_reason"] == "NO_MORE_RETRIES"
    assert fast["delays_ms"] == []
    assert data["attempt_effect"] == "NOT_SENT"
    assert data["attempt_effect_source"] == "reason_default"


# -- the effect decides: explain agrees with the core --------------------------------------


def test_grpc_unavailable_is_not_retried_for_a_non_idempotent_request(
    output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """UNAVAILABLE from a server maps to SERVICE_NOT_AVAILABLE + MAYBE_APPLIED: the effect wins."""
    rows = _rows(_explain(capsys, "grpc", "UNAVAILABLE"))
    for strategy in (BEST_EFFORT, FAST_FAIL):
        assert rows[(strategy, "idempotent")] == "retry after 1, 2, 4, 8, 16 ms, ...", strategy
        assert rows[(strategy, "non-idempotent")].startswith("fails: "), rows
        assert "retry after" not in rows[(strategy, "non-idempotent")]
    assert main(["explain", "grpc", "UNAVAILABLE", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["attempt_effect"] == "MAYBE_APPLIED"
    for outcome in data["outcomes"]:
        if not outcome["idempotent"]:
            assert outcome["delays_ms"] == [], outcome
            assert outcome["exception"] is not None, outcome


@pytest.mark.parametrize("reason", list(RetryReason), ids=lambda r: r.name)
def test_a_maybe_applied_attempt_is_never_retried_when_not_idempotent(
    reason: RetryReason,
) -> None:
    """Whatever the reason's flags (always-retry included), as the core decides."""
    for outcome in explain_outcomes(reason, AttemptEffect.MAYBE_APPLIED):
        if outcome.idempotent:
            continue
        assert outcome.delays_ms == (), outcome
        assert outcome.exception is not None, outcome


def test_a_not_applied_attempt_keeps_the_reason_s_rule() -> None:
    """NOT_APPLIED and NOT_SENT attempts retry as the reason's flags say (unchanged)."""
    for effect in (AttemptEffect.NOT_APPLIED, AttemptEffect.NOT_SENT):
        for outcome in explain_outcomes(RetryReason.SERVICE_NOT_AVAILABLE, effect):
            assert outcome.delays_ms == (1.0, 2.0, 4.0, 8.0, 16.0), (effect, outcome)
        for outcome in explain_outcomes(RetryReason.KV_NOT_MY_VBUCKET, effect):
            assert outcome.delays_ms == (1.0, 10.0, 50.0, 100.0, 500.0), (effect, outcome)
