"""The ``sdkcore`` command line: ``demo``, ``explain``, ``check-config`` and ``--version``.

The frame every command writes through is :mod:`sdkcore._console` (:class:`Output`);
:func:`main` turns a closed pipe (``sdkcore ... | head -2``) into a quiet exit
instead of a traceback. Nothing here is imported by ``import sdkcore``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Sequence

from ._console import WIDTH, Output, UsageError, install_hint
from ._version import __version__

__all__ = ["WIDTH", "Output", "UsageError", "main"]  # the frame is _console's, re-exported

#: Exit code after stdout was closed early by the reader (128 + SIGPIPE, as a shell reports it).
EXIT_BROKEN_PIPE = 141


def _silence_stdout() -> None:
    """After the reader closed the pipe: send what is still buffered to /dev/null."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - no real stdout
        pass


def _run_demo(argv: Sequence[str]) -> int:
    try:
        demo = importlib.import_module("sdkcore._demo")
    except ModuleNotFoundError as exc:
        if exc.name == "sdkcore._demo":
            sys.stderr.write(
                "sdkcore demo: not available in this installation (the sdkcore._demo package "
                "is missing)\n"
            )
            return 2
        missing = None if exc.name is None else exc.name.split(".")[0]
        if missing in ("grpc", "rich"):
            sys.stderr.write(f"sdkcore demo needs {missing}: {install_hint(missing)}\n")
            return 2
        raise
    return int(demo.main(list(argv)))


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's own parser by name."""
    from . import _check_config, _explain

    parser = argparse.ArgumentParser(
        prog="sdkcore",
        description="sdkcore: the retry brain of a database/RPC SDK core.",
        epilog="Run 'sdkcore COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"sdkcore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "demo",
        help="run a workload against a troubled in-process server under each retry strategy",
        add_help=False,
    )
    _explain.add_parser(sub)
    _check_config.add_parser(sub)
    return parser, sub.choices


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "demo":  # the demo parses its own options
        return _run_demo(args_list[1:])
    parser, commands = _build()
    if not args_list or args_list == ["explain"]:
        # No command (or no kind to explain): the help, on stderr, with the usage-error
        # exit code 2 argparse gives for any other missing argument (--help: stdout, 0).
        shown = commands[args_list[0]] if args_list else parser
        sys.stderr.write(shown.format_help())
        return 2
    args, extras = parser.parse_known_args(args_list)
    try:
        if extras:
            raise UsageError(_unrecognized(extras, getattr(args, "kind", None)))
        return int(args.run(args, Output()))
    except UsageError as exc:
        text = f"sdkcore {args.command}: error: {exc}"
        lines = [textwrap.fill(line, WIDTH, subsequent_indent="  ") for line in text.split("\n")]
        sys.stderr.write("\n".join(lines) + "\n")
        return 2


def _unrecognized(extras: list[str], kind: str | None) -> str:
    """What a command's parser left over, and, for an option some ``explain`` kind takes,
    where it goes (``--opcode`` on ``explain reason`` was the top level's bare
    "unrecognized arguments", naming neither the command nor that it is kv's option)."""
    from . import _explain

    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    for extra in extras:
        if not extra.startswith("--"):
            continue
        option = extra.split("=", 1)[0]
        kinds = _explain.kinds_taking(option)
        if kind is not None and kind in kinds:
            lines.append(f"{option} goes after the kind: sdkcore explain {kind} [{option}] VALUE")
        elif kinds:
            owners = ", ".join(f"'explain {k}'" for k in kinds)
            takes = f"'explain {kind}' takes no {option}: it is" if kind else f"{option} is"
            lines.append(f"{takes} an option of {owners} only")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (``python -m sdkcore`` raises SystemExit)."""
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # `sdkcore ... | head -2`: the reader has what it wanted; no traceback.
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
