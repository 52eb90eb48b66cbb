"""The ``sdkcore`` command frame: subcommands, --version, output rules, closed pipes, import."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import sdkcore
from sdkcore._cli import WIDTH, Output, main

ROOT = Path(__file__).resolve().parent.parent
ANSI = "\x1b["


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sdkcore", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"sdkcore {sdkcore.__version__}\n"


def test_unknown_command_exits_2_naming_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err
    for command in ("demo", "explain", "check-config"):
        assert command in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["explain", "reason", "KV_LOCKED", "--opcode", "get"],
            [
                "sdkcore explain: error: unrecognized arguments: --opcode get",
                "'explain reason' takes no --opcode: it is an option of 'explain kv' only",
            ],
        ),
        (
            ["explain", "grpc", "UNAVAILABLE", "--body=x"],
            [
                "sdkcore explain: error: unrecognized arguments: --body=x",
                "'explain search', 'explain views' only",
            ],
        ),
        (  # the kind's own option, written before the kind
            ["explain", "--json", "kv", "0x01"],
            ["--json goes after the kind: sdkcore explain kv [--json] VALUE"],
        ),
        (  # an option nobody takes: no kind blamed
            ["--bogus", "explain", "reason", "KV_LOCKED"],
            ["sdkcore explain: error: unrecognized arguments: --bogus\n"],
        ),
        (["check-config", "x.json", "--foo"], ["sdkcore check-config: error: unrecognized"]),
    ],
)
def test_an_option_of_another_kind_names_the_command_and_the_kinds_that_take_it(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: list[str]
) -> None:
    """rfc/0005: errors are "sdkcore COMMAND: error: ..." naming what is accepted. A kv
    option on another kind was the top level's bare "unrecognized arguments" after the
    top level's usage line (an operator's review)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert not captured.err.startswith("usage:")
    for text in says:
        assert text in captured.err


def test_no_command_shows_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    """`sdkcore` alone: the whole help (every command), exit 2 as for a missing argument."""
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: sdkcore")
    for command in ("demo", "explain", "check-config", "--version"):
        assert command in captured.err
    assert "Run 'sdkcore COMMAND --help'" in captured.err


def test_explain_without_a_kind_shows_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sdkcore explain")
    for kind in ("kv", "query", "analytics", "search", "views", "grpc", "reason"):
        assert kind in err


def test_a_stream_that_cannot_encode_gets_escapes_not_a_traceback() -> None:
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    Output(stream, use_rich=False).line("caf\u00e9 \u2500")
    stream.flush()
    assert raw.getvalue() == b"caf\\xe9 \\u2500\n"


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "explain", "check-config", "--version"):
        assert command in out


def test_demo_is_delegated_with_its_own_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    fake = types.ModuleType("sdkcore._demo")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sdkcore._demo", fake)
    assert main(["demo", "--json", "--scenario", "auth", "-v"]) == 3
    assert seen == [["--json", "--scenario", "auth", "-v"]]


def test_demo_without_its_package_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "sdkcore._demo", None)  # import fails as if missing
    assert main(["demo"]) == 2
    assert "sdkcore demo: not available" in capsys.readouterr().err


def test_output_plain_without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)
    buf = io.StringIO()
    out = Output(buf)
    assert out.rich is None
    out.table(("a", "long text"), [("x", "word " * 60)], title="t")
    text = buf.getvalue()
    assert ANSI not in text
    assert "-" in text.splitlines()[2]  # the plain rule under the header
    assert all(len(line) <= WIDTH for line in text.splitlines())
    assert text.count("word") == 60  # wrapped, not cut


def test_ascii_stream_gets_ascii_tables() -> None:
    pytest.importorskip("rich")

    class Ascii(io.StringIO):
        encoding = "ascii"

    buf = Ascii()
    Output(buf).table(("flag", "meaning"), [("always_retry", "yes")])
    text = buf.getvalue()
    text.encode("ascii")  # nothing a strict ASCII stream would reject
    assert "-----" in text


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_and_never_with_no_color(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("rich")
    monkeypatch.delenv("NO_COLOR", raising=False)
    tty = _Tty()
    Output(tty).heading("hello")
    assert ANSI in tty.getvalue()

    pipe = io.StringIO()
    Output(pipe).heading("hello")
    assert pipe.getvalue() == "hello\n"

    monkeypatch.setenv("NO_COLOR", "1")
    tty = _Tty()
    Output(tty).heading("hello")
    Output(tty).table(("a", "b"), [("1", "2")])
    assert ANSI not in tty.getvalue()


def test_closed_pipe_exits_quietly() -> None:
    """`sdkcore explain ... | head -0`: the reader is gone before anything is written."""
    r, w = os.pipe()
    os.close(r)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "sdkcore", "explain", "reason", "KV_LOCKED"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    finally:
        os.close(w)
    assert done.stderr == ""
    assert done.returncode == 141


def test_piped_head_gets_the_first_lines() -> None:
    done = subprocess.run(
        f"'{sys.executable}' -m sdkcore explain reason KV_LOCKED | head -2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0
    assert done.stderr == ""
    assert done.stdout.splitlines()[0] == "RetryReason KV_LOCKED"


def test_import_sdkcore_stays_lean() -> None:
    """``import sdkcore`` loads none of the command line, rich, argparse or grpc, and not
    structlog either (imported on the first event: ``import structlog`` loads rich when it is
    installed, and an application that never imported structlog cannot have configured it)."""
    code = (
        "import sys; before = set(sys.modules); import sdkcore; "
        "new = set(sys.modules) - before; "
        "bad = sorted(m for m in new if m.split('.')[0] in ('rich', 'grpc', 'argparse', "
        "'structlog') "
        "or m.startswith(('sdkcore._cli', 'sdkcore._explain', 'sdkcore._check_config', "
        "'sdkcore._demo', 'sdkcore.testing', 'sdkcore.grpc', 'sdkcore.mapping'))); print(bad)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_console_script_runs() -> None:
    done = _run("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"sdkcore {sdkcore.__version__}"


# -- issue 21: every column labelled; install hints that work today ----------------------


@pytest.mark.parametrize("use_rich", [False, True])
def test_a_table_column_without_a_header_is_refused(
    use_rich: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if use_rich:
        pytest.importorskip("rich")
    else:
        monkeypatch.setitem(sys.modules, "rich", None)
    out = Output(io.StringIO())
    with pytest.raises(ValueError, match=r"column 1 has a blank header; every column needs"):
        out.table(("flag", "", "meaning"), [("always_retry", "yes", "...")])
    with pytest.raises(ValueError, match="column 0 has a blank header"):
        out.table((" ", "b"), [("1", "2")])


def test_the_rich_hint_installs_what_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """sdkcore is not on PyPI: `pip install 'sdkcore[cli]'` fails; the hint must not say it."""
    from sdkcore._console import UsageError, install_hint

    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(UsageError) as exc:
        Output(io.StringIO(), use_rich=True)
    message = str(exc.value)
    assert message.startswith("rich is not installed: pip install rich ")
    assert "pip install -e '/path/to/sdkcore[cli]'" in message
    assert "pip install 'sdkcore" not in message
    assert "pip install sdkcore" not in message
    assert install_hint("grpc").startswith("pip install grpcio ")


@pytest.mark.parametrize("module", ["grpc", "rich"])
def test_the_demo_hint_when_its_import_fails(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> types.ModuleType:
        if name == "sdkcore._demo":
            raise ModuleNotFoundError(f"No module named {module!r}", name=f"{module}.aio")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    package = {"grpc": "grpcio", "rich": "rich"}[module]
    assert err.startswith(f"sdkcore demo needs {module}: pip install {package} ")
    assert "pip install 'sdkcore" not in err


def test_no_cli_message_suggests_installing_sdkcore_from_pypi() -> None:
    """The messages the command frame and explain print (the demo's are its own)."""
    for name in ("_cli.py", "_console.py", "_explain.py", "_check_config.py"):
        text = (ROOT / "sdkcore" / name).read_text(encoding="utf-8")
        assert "pip install 'sdkcore" not in text, name
        assert "pip install sdkcore" not in text, name
