"""``sdkcore explain``: what sdkcore does with one server answer.

The answer is mapped with :mod:`sdkcore.mapping` (the same functions an SDK's I/O
code calls), then, for a retry reason, the real orchestrator and built-in
strategies are driven on throwaway requests with a virtual clock: the table shows
what they decide, never a re-statement of the rules. Whether a non-idempotent
request is sent again after an attempt that may have been applied is the core's
decision too (``sdkcore._decision.decide``, reached through ``maybe_retry`` with the
attempt effect the mapper recorded): ``explain`` has no rule of its own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import anyio

from ._console import Output, UsageError
from ._context import AttemptEffect
from ._decision import CONTROLLED_SECONDS
from ._errors import CouchbaseException, RetryableError
from ._orchestrator import RetryOrchestrator
from ._reason import RetryReason
from ._request import Request
from ._strategy import (
    BestEffortRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
    RetryStrategy,
)
from ._untrusted import printable, show
from .mapping import (
    GrpcCode,
    KvOpcode,
    KvStatus,
    analytics_retry_reason,
    grpc_code,
    grpc_failure,
    is_idempotent_kv,
    kv_failure,
    query_retry_reason,
    search_exception,
    search_retry_reason,
    views_retry_reason,
)
from .testing import VirtualClock, capture_retry_events

__all__ = [
    "KINDS",
    "Outcome",
    "add_parser",
    "explain_outcomes",
    "explain_reason",
    "retry_after_note",
    "run",
]

#: How many retries the strategy table plays.
RETRIES_SHOWN = 5

#: The strategies the table plays: the exported ones (``sdkcore.__all__``), shown by
#: their class names. FailFastRetryStrategy is internal (RFC 0049: SDK-internal requests).
STRATEGIES: tuple[type[RetryStrategy], ...] = (
    BestEffortRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
)

_CONTROLLED_MS = ", ".join(f"{s * 1000:g}" for s in CONTROLLED_SECONDS)

_FLAG_HELP = {
    "allows_non_idempotent_retry": (
        "RFC 0049 allows retrying a non-idempotent request for this reason, unless an "
        "attempt may have been applied (attempt effect MAYBE_APPLIED)",
        "a non-idempotent request is never retried for this reason",
    ),
    "always_retry": (
        f"retried with controlled backoff ({_CONTROLLED_MS} ms) whatever the strategy, "
        "unless the request is non-idempotent and an attempt may have been applied",
        "the request's retry strategy decides",
    ),
    "after_dispatch": (
        "a failure with this reason may have reached the network",
        "by default, a failure with this reason never left the client",
    ),
}

#: What the retry_after of a local refusal is, for the reasons whose refusal may carry one
#: (the keys of ``sdkcore._failing._HINTED_BY``, checked by tests/test_operator_reports.py):
#: the orchestrator waits the longer of it and the backoff the table shows.
_HINTS: dict[RetryReason, str] = {
    RetryReason.CIRCUIT_BREAKER_OPEN: (
        "an OPEN CircuitBreaker's refusal carries retry_after (the rest of the breaker's sleep "
        "window, until its probe may go; 5 s by default; none while its probe is out): "
        "each retry waits the longer of it "
        "and the backoff above, so the real waits follow the sleep window, not these delays; "
        "a request whose deadline comes before the window ends times out at once"
    ),
    RetryReason.CONCURRENCY_LIMITED: (
        "an AdaptiveConcurrencyLimiter's refusal carries retry_after (its last measured round "
        "trip; a ConcurrencyLimiter's carries none): each retry waits the longer of it and the "
        "backoff above"
    ),
    RetryReason.CLIENT_THROTTLED: (
        "an AdaptiveThrottle's refusal carries no retry_after: the retries wait the backoff "
        "above; a refusal raised with one (RetryableError(CLIENT_THROTTLED, retry_after=...)) "
        "waits the longer of it and the backoff"
    ),
}


def retry_after_note(reason: RetryReason) -> str | None:
    """What the retry_after a refusal for ``reason`` carries does to the delays, or None."""
    return _HINTS.get(reason)


#: The range each numeric input is checked against, as (low, high, how it is shown).
_RANGES: dict[str, tuple[int, int, str]] = {
    "kv": (0, 0xFFFF, "0..0xffff"),
    "opcode": (0, 0xFF, "0..0xff"),
    "query": (1, 99999, "1..99999"),
    "analytics": (1, 99999, "1..99999"),
    "search": (100, 599, "100..599"),
    "views": (100, 599, "100..599"),
    "grpc": (0, 16, "0..16"),
}

#: kind -> (value metavar, help, accepted values for error messages)
KINDS: dict[str, tuple[str, str, str]] = {
    "kv": ("STATUS", "a KV status", "a number (0x07, 7) or a name such as NOT_MY_VBUCKET"),
    "query": ("CODE", "a query error code", "an error code 1..99999 such as 4050"),
    "analytics": ("CODE", "an analytics error code", "an error code 1..99999 such as 23000"),
    "search": ("HTTP_STATUS", "a search HTTP status", "an HTTP status 100..599 such as 429"),
    "views": ("HTTP_STATUS", "a views HTTP status", "an HTTP status 100..599 such as 302"),
    "grpc": (
        "CODE",
        "a Couchbase gRPC status code",
        "a status name such as UNAVAILABLE or a number 0..16",
    ),
    "reason": ("NAME", "a RetryReason", "a RetryReason name such as KV_LOCKED"),
}


#: Each kind's parser (filled by :func:`add_parser`): which kinds take an option.
OPTIONS: dict[str, Any] = {}


def kinds_taking(option: str) -> list[str]:
    """The kinds whose parser takes ``option`` (``--opcode``: ``["kv"]``)."""
    return [kind for kind, p in OPTIONS.items() if option in p._option_string_actions]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "explain",
        help="explain what a server answer or retry reason leads to under each strategy",
        description=(
            "Map a server answer to its retry reason (or exception) with sdkcore.mapping, and "
            "show what " + " and ".join(s.__name__ for s in STRATEGIES) + " do with it."
        ),
    )
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, (metavar, what, accepted) in KINDS.items():
        p = kinds.add_parser(kind, help=f"explain {what}", description=f"{what}: {accepted}")
        OPTIONS[kind] = p
        p.add_argument("value", metavar=metavar, help=accepted)
        p.add_argument(
            "--json",
            action="store_true",
            help="print the answer as JSON (keys are snake_case identifiers) instead of tables",
        )
        if kind == "kv":
            p.add_argument(
                "--opcode",
                default="GET",
                help="the request's opcode: a name (GET, UPSERT, ...) or a number (default GET)",
            )
        elif kind == "query":
            p.add_argument("--message", default="", help="the error's msg text")
            p.add_argument("--retry", action="store_true", help='the error has "retry": true')
        elif kind in ("search", "views"):
            p.add_argument("--body", default="", help="the response body")
        elif kind == "grpc":
            p.add_argument(
                "--read-only",
                action="store_true",
                help="the call was read-only (DEADLINE_EXCEEDED is then unambiguous)",
            )
    parser.set_defaults(run=run)


# -- parsing the value ---------------------------------------------------------------------


#: Past this many characters int() raises for its digit limit (4300): such a text is
#: judged by _LONG_INT instead, a decimal literal as int(text, 0) reads one.
_INT_MAX_DIGITS = 4000
_LONG_INT = re.compile(r"[+-]?[1-9](_?[0-9])*")


def _number(text: str) -> int | None:
    """``text`` as an int (``7``, ``0x07``, ``-5``), or None when it is not a number."""
    digits = text.strip()
    if len(digits) > _INT_MAX_DIGITS:  # int() refuses this many digits (Python's limit)
        if _LONG_INT.fullmatch(digits) is None:
            return None
        return -(10**33) if digits[:1] == "-" else 10**33  # out of range, with its sign
    try:
        return int(digits, 0)
    except ValueError:
        return None


def _in_range(value: int, text: str, kind: str, what: str) -> int:
    low, high, shown = _RANGES[kind]
    if not low <= value <= high:
        raise UsageError(f"{what} {show(text)} is out of range; expected {shown}")
    return value


def _int(text: str, kind: str) -> int:
    value = _number(text)
    if value is None:
        raise UsageError(f"{kind}: {show(text)} is not a number; expected {KINDS[kind][2]}")
    return _in_range(value, text, kind, f"{kind}: error code")


def _names(names: Sequence[str]) -> str:
    return textwrap.fill(", ".join(names), 96, initial_indent="  ", subsequent_indent="  ")


def _kv_status(text: str) -> int:
    name = text.strip().upper()
    if name in KvStatus.__members__:
        value: int | None = KvStatus[name].value
    else:
        value = _number(text)
    if value is None:
        raise UsageError(
            f"kv: unknown status {show(text)}; expected a number (0x07, 7) or one of:\n"
            + _names([n for n in KvStatus.__members__ if n != "SUCCESS"])
        )
    _in_range(value, text, "kv", "kv: status")
    if value == KvStatus.SUCCESS:
        raise UsageError(
            "kv: status 0x00 is SUCCESS, not a failure: the request completes with its result"
        )
    return value


def _kv_opcode(text: str) -> int:
    name = text.strip().upper()
    aliases = {"UPSERT": "SET", "INSERT": "ADD", "REMOVE": "DELETE"}
    name = aliases.get(name, name)
    if name in KvOpcode.__members__:
        return KvOpcode[name].value
    value = _number(text)
    if value is None:
        raise UsageError(
            f"kv --opcode: unknown opcode {show(text)}; expected a number (0x00) or one of "
            "(upsert, insert, remove are accepted for SET, ADD, DELETE):\n"
            + _names([n for n in KvOpcode.__members__ if not n.startswith("DCP_")])
        )
    return _in_range(value, text, "opcode", "kv --opcode")


def _reason(text: str) -> RetryReason:
    name = text.strip().upper()
    if name.startswith("RETRYREASON."):
        name = name[len("RETRYREASON.") :]
    if name in RetryReason.__members__:
        return RetryReason[name]
    raise UsageError(
        f"reason: unknown retry reason {show(text)}; one of:\n"
        + _names(list(RetryReason.__members__))
    )


def _opcode_name(opcode: int) -> str:
    try:
        return f"{KvOpcode(opcode).name} (0x{opcode:02x})"
    except ValueError:
        return f"opcode 0x{opcode:02x}"


def _status_name(status: int) -> str:
    try:
        return f"0x{status:02x} {KvStatus(status).name}"
    except ValueError:
        return f"0x{status:02x} (not a status sdkcore knows)"


Mapped = RetryReason | RetryableError | CouchbaseException | None


def _success(kind: str, status: int) -> UsageError:
    return UsageError(
        f"{kind}: HTTP {status} is a success, not a failure: the request completes with its result"
    )


def _map(args: argparse.Namespace) -> tuple[str, Mapped, str]:
    """(what was asked, what the mapping says, which mapper said it)."""
    kind = args.kind
    value = args.value
    if kind == "reason":
        reason = _reason(value)
        return f"RetryReason {reason.name}", reason, ""
    if kind == "kv":
        status = _kv_status(value)
        opcode = _kv_opcode(args.opcode)
        what = f"KV status {_status_name(status)} on {_opcode_name(opcode)}"
        return what, kv_failure(status, opcode), "sdkcore.mapping.kv_failure"
    if kind == "grpc":
        number = _number(value)
        try:
            if number is not None:
                code = grpc_code(_in_range(number, value, "grpc", "grpc: status code"))
            else:
                code = grpc_code(value)
        except ValueError:
            raise UsageError(
                f"grpc: unknown status code {show(value)}; a number 0..16 or one of:\n"
                + _names([c.name for c in GrpcCode])
            ) from None
        if code is GrpcCode.OK:
            raise UsageError("grpc: OK is not a failure: the call completes with its result")
        what = f"gRPC status {code.name} ({code.value})" + (
            " on a read-only call" if args.read_only else ""
        )
        return what, grpc_failure(code, read_only=args.read_only), "sdkcore.mapping.grpc_failure"
    if kind == "query":
        number = _int(value, kind)
        error: dict[str, Any] = {"code": number, "msg": args.message}
        if args.retry:
            error["retry"] = True
        what = f"query error {number}" + (f" ({args.message!r})" if args.message else "")
        what += ' with "retry": true' if args.retry else ""
        return what, query_retry_reason([error]), "sdkcore.mapping.query_retry_reason"
    if kind == "analytics":
        number = _int(value, kind)
        mapped = analytics_retry_reason([{"code": number, "msg": ""}])
        return f"analytics error {number}", mapped, "sdkcore.mapping.analytics_retry_reason"
    parsed = _number(value)
    if parsed is None:
        raise UsageError(f"{kind}: {show(value)} is not a number; expected {KINDS[kind][2]}")
    status = parsed
    if not 100 <= status <= 599:
        raise UsageError(f"{kind}: {show(value)} is not an HTTP status; expected 100..599")
    if 200 <= status <= 299:
        raise _success(kind, status)
    if kind == "search":
        found: Mapped = search_retry_reason(status, args.body)
        mapper = "sdkcore.mapping.search_retry_reason"
        if found is None and status >= 400:
            found = search_exception(status, args.body)
            mapper = "sdkcore.mapping.search_exception"
        return f"search HTTP {status}", found, mapper
    return (
        f"views HTTP {status}",
        views_retry_reason(status, args.body),
        ("sdkcore.mapping.views_retry_reason"),
    )


# -- driving the orchestrator ------------------------------------------------------------------


def _ms(delay: timedelta) -> float:
    return round(delay.total_seconds() * 1000, 3)


class Outcome(NamedTuple):
    """What the orchestrator did with one strategy and one kind of request."""

    #: The strategy's class name (an exported one, see :data:`STRATEGIES`).
    strategy: str
    idempotent: bool
    #: The delays it waited before each retry, in ms (at most :data:`RETRIES_SHOWN`).
    delays_ms: tuple[float, ...]
    #: The exception the request failed with, by class name; None: still retrying.
    exception: str | None
    #: The failure's ``context.cancellation_reason`` name, if any.
    cancellation_reason: str | None

    @property
    def request(self) -> str:
        return "idempotent" if self.idempotent else "non-idempotent"

    def text(self) -> str:
        delays = ", ".join(f"{d:g}" for d in self.delays_ms)
        if self.exception is None:
            return f"retry after {delays} ms, ..."
        why = f" ({self.cancellation_reason})" if self.cancellation_reason else ""
        failed = f"fails: {self.exception}{why}"
        return f"retry after {delays} ms, then {failed}" if delays else failed

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "idempotent": self.idempotent,
            "delays_ms": list(self.delays_ms),
            "retries_go_on": self.exception is None,
            "exception": self.exception,
            "cancellation_reason": self.cancellation_reason,
        }


async def _play(
    strategy: type[RetryStrategy],
    reason: RetryReason,
    idempotent: bool,
    effect: AttemptEffect | None = None,
) -> Outcome:
    """What the orchestrator does with ``reason`` on a fresh request, retry after retry.

    The real ``maybe_retry`` decides (the core's rule, with ``effect`` recorded for
    every attempt): nothing here restates when a request is retried.
    """
    clock = VirtualClock()
    orchestrator = RetryOrchestrator(default_strategy=strategy(), sleep=clock.sleep)
    request = Request(name="explain", idempotent=idempotent, timeout=None, clock=clock.clock)
    delays: list[float] = []
    for _ in range(RETRIES_SHOWN):
        try:
            delays.append(_ms(await orchestrator.maybe_retry(request, reason, effect=effect)))
        except CouchbaseException as exc:
            context = exc.context
            why = None
            if context is not None and context.cancellation_reason is not None:
                why = context.cancellation_reason.name
            return Outcome(strategy.__name__, idempotent, tuple(delays), type(exc).__name__, why)
    return Outcome(strategy.__name__, idempotent, tuple(delays), None, None)


def explain_outcomes(reason: RetryReason, effect: AttemptEffect | None = None) -> list[Outcome]:
    """What the orchestrator does for each exported strategy, idempotent or not.

    ``effect`` is what the failed attempts are recorded with (default: the reason's).
    """

    async def table() -> list[Outcome]:
        return [
            await _play(strategy, reason, idempotent, effect)
            for strategy in STRATEGIES
            for idempotent in (True, False)
        ]

    with capture_retry_events():  # the decisions are shown, not logged
        return anyio.run(table)


def explain_reason(
    reason: RetryReason, effect: AttemptEffect | None = None
) -> list[tuple[str, str, str]]:
    """(strategy, request kind, what happens) for each exported strategy: the table's rows."""
    return [(o.strategy, o.request, o.text()) for o in explain_outcomes(reason, effect)]


def _effect(reason: RetryReason, effect: AttemptEffect | None) -> tuple[AttemptEffect, bool]:
    """(the effect the attempts are recorded with, whether a mapper recorded it)."""
    if effect is None:
        return AttemptEffect.for_reason(reason), False
    return effect, True


def _flags(out: Output, reason: RetryReason, effect: AttemptEffect | None, mapper: str) -> None:
    """The reason's RFC 0049 flags, then the one row that says what the attempt effect means."""
    rows = []
    overridden = effect is not None and effect is not AttemptEffect.for_reason(reason)
    for flag, (yes, no) in _FLAG_HELP.items():
        on = bool(getattr(reason, flag))
        meaning = yes if on else no
        if flag == "after_dispatch" and overridden:
            meaning += "; this answer came from the server: the attempt effect below applies"
        rows.append((flag, "yes" if on else "no", meaning))
    recorded, by_mapper = _effect(reason, effect)
    source = f"recorded by {mapper}" if by_mapper else "the reason's default"
    rows.append(("attempt effect", recorded.name, f"{source}: {_EFFECT_HELP[recorded]}"))
    out.table(_FLAG_COLUMNS, rows)


#: The headers of the two tables: every column has one (plain text and rich alike).
_FLAG_COLUMNS = ("property", "value", "meaning")
_STRATEGY_COLUMNS = ("strategy", "request", "outcome")

_EFFECT_HELP = {
    AttemptEffect.NOT_SENT: "never left the client: a later timeout is unambiguous",
    AttemptEffect.NOT_APPLIED: (
        "the server's answer proves nothing was applied: on its own, a later timeout is unambiguous"
    ),
    AttemptEffect.MAYBE_APPLIED: (
        "may have been applied: a non-idempotent request is never sent again, whatever the "
        "reason's flags, and its timeout is ambiguous"
    ),
}


def _to_json(
    args: argparse.Namespace,
    what: str,
    mapped: Mapped,
    mapper: str,
    effect: AttemptEffect | None,
    opcode_idempotent: bool | None,
) -> dict[str, Any]:
    """The answer as JSON: snake_case keys, stable across releases (values may be null)."""
    out: dict[str, Any] = {
        "kind": args.kind,
        "value": args.value,
        "answer": what,
        "mapped_by": mapper or None,
        "retry_reason": None,
        "exception": None,
    }
    if opcode_idempotent is not None:
        out["opcode_idempotent"] = opcode_idempotent
    if isinstance(mapped, RetryReason):
        recorded, by_mapper = _effect(mapped, effect)
        out["retry_reason"] = mapped.name
        out["flags"] = {flag: bool(getattr(mapped, flag)) for flag in _FLAG_HELP}
        out["attempt_effect"] = recorded.name
        out["attempt_effect_source"] = "mapper" if by_mapper else "reason_default"
        out["retries_shown"] = RETRIES_SHOWN
        out["outcomes"] = [o.to_json() for o in explain_outcomes(mapped, effect)]
        out["retry_after_note"] = retry_after_note(mapped)
    elif isinstance(mapped, CouchbaseException):
        out["exception"] = {"type": type(mapped).__name__, "message": mapped.message}
    return out


def run(args: argparse.Namespace, out: Output) -> int:
    what, mapped, mapper = _map(args)
    note = ""
    opcode_idempotent: bool | None = None
    if args.kind == "kv":
        opcode_idempotent = is_idempotent_kv(_kv_opcode(args.opcode))
        note = f"  (the opcode is {'' if opcode_idempotent else 'not '}idempotent: RFC 0049 list)"
    effect: AttemptEffect | None = None
    if isinstance(mapped, RetryableError):
        effect = mapped.effect
        mapped = mapped.reason
    if getattr(args, "json", False):
        data = _to_json(args, what, mapped, mapper, effect, opcode_idempotent)
        out.write(json.dumps(data, indent=2) + "\n")
        return 0
    if args.kind == "grpc" and effect is AttemptEffect.MAYBE_APPLIED:
        note = (
            "  (a status received from a server: gRPC does not promise that it means nothing "
            "was applied, so the mapping records MAYBE_APPLIED, as an sdkcore.grpc channel does)"
        )
    if isinstance(mapped, RetryReason):
        if mapper:
            out.heading(f"{what} -> retry reason {mapped.name}")
            out.line(f"  (mapped by {mapper})")
        else:
            out.heading(what)
        if note:
            out.line(note)
        out.line()
        _flags(out, mapped, effect, mapper)
        out.line()
        out.heading(f"What each strategy does (first {RETRIES_SHOWN} retries, no timeout)")
        out.table(_STRATEGY_COLUMNS, explain_reason(mapped, effect))
        out.line()
        hint = retry_after_note(mapped)
        if hint is not None:
            out.line(f"{hint[0].upper()}{hint[1:]}.")
            out.line()
        out.line(
            "'...': the retries go on until the request's timeout. "
            "With a timeout, a delay that reaches the deadline is cut short and the request "
            "times out (ambiguous if it is non-idempotent and some attempt may have been "
            'applied, rfc/0001 "Ambiguity").'
        )
        return 0
    out.heading(what)
    if isinstance(mapped, CouchbaseException):
        out.line(f"  -> {type(mapped).__name__}: {printable(mapped.message)}")
        out.line(f"  (mapped by {mapper})")
        if note:
            out.line(note)
        out.line()
        out.line(
            "Not a retry reason: the request completes with this exception at once, under every "
            "retry strategy (no strategy is consulted)."
        )
        return 0
    out.line(f"  -> not a retry reason ({mapper} returns None)")
    out.line()
    out.line(
        "The request is not handed to the orchestrator: the SDK completes it with what the "
        "service answered, under every retry strategy (no strategy is consulted)."
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: sdkcore explain ...")
