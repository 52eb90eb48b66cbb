"""``sdkcore demo``: sdkcore against a small, troubled cluster (see rfc/0006-demo.md).

An in-process grpc.aio server on 127.0.0.1 misbehaves the way a Couchbase cluster
does (rebalance, a locked document, a restarting node, overload with pushback,
wrong credentials, a slow replica); a mixed workload of idempotent reads and
non-idempotent writes runs against it through ``RetryOrchestrator.execute`` with
the mapping module, the ``sdkcore.grpc`` channels with a service config, and hedged
reads, once per retry strategy. A slow in-process endpoint offered twice its capacity
shows the same load without and with an adaptive concurrency limiter. When
``memcached`` is installed, a last scenario
kills and restarts a real one under the example memcached client (circuit
breakers, a retry budget). This package is the application: it configures
structlog for its own run (and restores it); the library never does.

Needs grpcio; ``--metrics-port`` also needs the OpenTelemetry SDK and its
Prometheus exporter: the ``demo`` extra brings all three. Uses rich for the
progress bar when it is installed (the ``cli`` extra). sdkcore is not on PyPI: from
a checkout, ``uv run --no-dev --extra demo sdkcore demo``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._install import install_hint

__all__ = ["main"]

# Kept here (not in _workload) so that --help and the grpcio check work without grpcio.
SCENARIO_HELP = {
    "rebalance": "half the vbuckets answer NOT_MY_VBUCKET for 150 ms (a rebalance)",
    "locked": "document 'airline_10' is locked by another client for 300 ms",
    "node-restart": "node B is UNAVAILABLE for 300 ms; 2 writes it applied lose their reply",
    "overload": "the nodes push back for 200 ms: RESOURCE_EXHAUSTED, retry-pushback-ms 40",
    "bad-credentials": "bucket 'billing' is opened with a wrong password (UNAUTHENTICATED)",
    "slow-replica": "reads from replica 0, whose tail is long: 1 read in 7 takes 300 ms",
    "hedged-reads": "the same reads, hedged to replica 1 when replica 0 has not answered in 20 ms",
    "slowdown": "an endpoint serving 4 at a time, offered 2x: without and with an adaptive limiter",
    "memcached-outage": "real memcached killed and restarted: circuit breakers, a retry budget",
}
SCENARIO_NAMES = tuple(SCENARIO_HELP)
MEMCACHED = "memcached-outage"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdkcore demo",
        description=(
            "Run a mixed workload (idempotent reads, non-idempotent writes) against an\n"
            "in-process troubled cluster on 127.0.0.1, once per retry strategy, and report\n"
            "what each strategy did; then, when memcached is installed, kill and restart a\n"
            "real memcached under circuit breakers and a retry budget. Needs grpcio, and for\n"
            "--metrics-port the OpenTelemetry SDK and its Prometheus exporter (extra 'demo');\n"
            "rich (extra 'cli') adds a progress bar."
        ),
        epilog="scenarios (default: all):\n"
        + "\n".join(f"  {name:<16} {text}" for name, text in SCENARIO_HELP.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIO_NAMES,
        metavar="NAME",
        help="run only this scenario (repeatable; listed below)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results as JSON on stdout (nothing else goes to stdout)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="stream all of sdkcore's log events to stderr (retry.*, hedge.*, breaker.*, "
        "budget.*, limiter.*, throttle.*); without it, warnings only, and none of the breaker, "
        "budget, limiter or throttle events the report tells",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve sdkcore's metrics as Prometheus text at http://127.0.0.1:PORT/metrics while "
        "the demo runs (0: a free port; the URL is printed on stderr)",
    )
    parser.add_argument(
        "--linger",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="with --metrics-port: keep serving this long after the report (Ctrl-C stops)",
    )
    return parser


#: The longest --linger: a day.
MAX_LINGER = 86400.0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be a TCP port number from 0 to 65535 (0: a free port), got {text!r}"
        )
    return port


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0.0 <= seconds <= MAX_LINGER:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from 0 to {MAX_LINGER:.0f}, got {text!r}"
        )
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code.

    0 ok, 1 a check failed, 2 usage, missing grpcio, or ``--scenario memcached-outage``
    without memcached on PATH (the default run skips that scenario with one line).
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["demo"]:
        args_in = args_in[1:]
    parser = _parser()
    args = parser.parse_args(args_in)
    if args.linger and args.metrics_port is None:
        parser.error("--linger keeps the metrics endpoint serving: it needs --metrics-port PORT")
    if args.scenario and MEMCACHED in args.scenario:
        from ._mcserver import INSTALL, memcached_binary

        if memcached_binary() is None:
            # Asked for by name, it cannot be skipped: the run would not show what was asked.
            sys.stderr.write(
                f"sdkcore demo: --scenario {MEMCACHED} needs memcached, and there is none on "
                f"PATH; install it with: {INSTALL} (or your distro's package)\n"
            )
            return 2
    # grpc's C core logs connection teardown at info level unless told otherwise.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        import grpc  # noqa: F401
    except ImportError:
        sys.stderr.write(
            f"sdkcore demo needs grpcio: {install_hint('grpc')}; or run it from a "
            "checkout with: uv run --no-dev --extra demo sdkcore demo\n"
        )
        return 2
    endpoint = None
    if args.metrics_port is not None:
        from ._metrics import MetricsUnavailable, serve

        try:
            endpoint = serve(args.metrics_port)
        except MetricsUnavailable as exc:
            sys.stderr.write(f"sdkcore demo: {exc}\n")
            return 2
        sys.stderr.write(f"sdkcore demo: serving metrics at {endpoint.url}\n")
        sys.stderr.flush()
    try:
        return _run_and_report(args, None if endpoint is None else endpoint.telemetry, endpoint)
    finally:
        if endpoint is not None:
            endpoint.close()


def _run_and_report(args: argparse.Namespace, telemetry: Any, endpoint: Any) -> int:
    import asyncio

    from ._report import bold, colour_enabled, render_tail, render_text, to_json
    from ._run import run

    names = args.scenario or list(SCENARIO_NAMES)
    style: Any = bold if colour_enabled(sys.stdout) else (lambda s: s)
    # Piped or redirected, the text report streams: the head and the scenario list at
    # once, then each scenario's line as it ends. On a terminal, the progress bar (on
    # stderr, the same screen) shows the run and the report follows it in one piece.
    stream = not args.json and not _isatty(sys.stdout)

    def emit(lines: list[str]) -> None:
        if not _write("\n".join(lines) + "\n"):
            raise _ReaderGone

    try:
        with _logging(args.verbose):
            report = asyncio.run(
                run(
                    names,
                    progress=not args.json,
                    emit=emit if stream else _ignore,
                    style=style,
                    telemetry=telemetry,
                )
            )
        if args.json:
            text = json.dumps(to_json(report), indent=2) + "\n"
        else:
            lines = render_tail(report, style) if stream else render_text(report, style)
            text = "\n".join(lines) + "\n"
        if not _write(text):
            raise _ReaderGone
    except _ReaderGone:
        # the reader went away (e.g. `| head`): not an error, but a linger asked for is
        # not kept, and whoever asked for it is told why
        if endpoint is not None and args.linger > 0:
            sys.stderr.write("sdkcore demo: stdout closed: the run stopped, --linger ignored\n")
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("sdkcore demo: interrupted\n")  # one line, not two tracebacks
        return 130
    if endpoint is not None and args.linger > 0:
        _linger(endpoint.url, args.linger)
    return 0 if report.ok else 1


def _linger(url: str, seconds: float) -> None:
    """Keep serving ``url`` for ``seconds`` after the report (Ctrl-C ends it quietly).

    A piped stdout is let go first, so that its reader (``| jq``) gets the report's
    end of file at once instead of after the linger.
    """
    _release_stdout()
    sys.stderr.write(
        f"sdkcore demo: the run is over; still serving {url} for {seconds:g} s (Ctrl-C stops)\n"
    )
    sys.stderr.flush()
    until = time.monotonic() + seconds
    try:
        while (left := until - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
    except KeyboardInterrupt:
        pass


def _release_stdout() -> None:
    """Point a piped or redirected stdout at /dev/null (a terminal is left as it is)."""
    if _isatty(sys.stdout):
        return
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (ValueError, OSError, AttributeError):
        return  # not a real file (e.g. captured in-process): nothing to let go
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    except OSError:
        pass


class _ReaderGone(Exception):
    """stdout's reader closed the pipe: stop the run, quietly."""


def _ignore(lines: list[str]) -> None:
    pass


def _isatty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):
        return False


def _write(text: str) -> bool:
    """Write to stdout; False (quietly) when the pipe closed."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that
        # flush does not fail with a traceback either.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return False
    return True


#: Events of the protection a scenario shows on purpose, logged to stderr with -v only.
_SHOWN_IN_THE_REPORT = ("breaker.", "budget.", "limiter.", "throttle.")


class _logging:
    """structlog for this run: sdkcore's events to stderr (all with -v, else warnings).

    The demo is an application, so it may configure structlog; the configuration
    it found is restored afterwards (main() is also called in-process by tests).
    """

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self._old: dict[str, Any] | None = None
        self._was_configured = False

    def __enter__(self) -> None:
        import structlog

        self._was_configured = structlog.is_configured()
        self._old = structlog.get_config()
        verbose = self.verbose

        def quiet_protection(_logger: Any, _method: str, event: Any) -> Any:
            # The protection the scenarios show on purpose (the memcached scenario's
            # breaker and budget, the slowdown scenario's limiter and throttle) is their
            # report's story: on stderr with -v only, their warnings included (a default
            # run printed limiter.refusing among the progress bar; an operator's review).
            if not verbose and str(event.get("event", "")).startswith(_SHOWN_IN_THE_REPORT):
                raise structlog.DropEvent
            return event

        structlog.configure(
            processors=[
                quiet_protection,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                structlog.dev.ConsoleRenderer(colors=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(
                logging.DEBUG if self.verbose else logging.WARNING
            ),
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
            cache_logger_on_first_use=False,
        )

    def __exit__(self, *exc: object) -> None:
        import structlog

        if self._was_configured and self._old is not None:
            structlog.configure(**self._old)
        else:
            structlog.reset_defaults()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
