"""``sdkcore check-config FILE``: validate a gRPC service config as sdkcore applies it.

Validation is :meth:`sdkcore.grpc.ServiceConfig.from_json` (gRPC A6 rules; no
grpcio needed). On top, warnings for what parses but is almost surely a mistake:
unknown keys (``retryPolicyy``, snake_case ``max_attempts``), a methodConfig that
names no method, ``OK`` among the retryable codes, a maxAttempts above the
client cap, an initialBackoff above maxBackoff, a hedgingDelay at or past the timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ._console import WIDTH, Output, UsageError
from ._untrusted import parse_int, printable
from .grpc._ignored_keys import HEDGING, METHOD, NAME, RETRY, ROOT, THROTTLING, unknown_keys
from .grpc._service_config import (
    DEFAULT_MAX_ATTEMPTS_CAP,
    MethodConfig,
    MethodName,
    ServiceConfig,
    ServiceConfigError,
)
from .grpc._status import STATUS_BY_NAME, status_name

__all__ = ["add_parser", "lint", "run", "summary"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "check-config",
        help="validate a gRPC service config and show the effective retry policy per method",
        description=(
            "Validate a gRPC service config with the A6 rules (retryPolicy, hedgingPolicy, "
            "retryThrottling) as sdkcore.grpc applies it. Exit 1 with every problem and its "
            "JSON path, or 0 with the effective policy per method. Warnings go to stderr."
        ),
    )
    parser.add_argument("file", metavar="FILE", help="the service config (JSON); - reads stdin")
    parser.add_argument(
        "--max-attempts-cap",
        type=int,
        default=DEFAULT_MAX_ATTEMPTS_CAP,
        metavar="N",
        help=f"the client's cap on maxAttempts (default {DEFAULT_MAX_ATTEMPTS_CAP}, as in A6)",
    )
    parser.set_defaults(run=run)


# -- warnings --------------------------------------------------------------------------------


def _unknown_keys(path: str, obj: Mapping[str, Any], known: frozenset[str]) -> list[str]:
    """The unknown keys of ``obj`` as warnings (the walk is the channels' too:
    ``sdkcore.grpc._ignored_keys``, whose ``grpc.config_ignored`` event lists them)."""
    out = []
    for key in unknown_keys(path, obj, known):
        hint = ""
        if key.camel_case:
            hint = f"; did you mean {key.suggestion!r}? (service config keys are camelCase)"
        elif key.suggestion is not None:
            hint = f"; did you mean {key.suggestion!r}?"
        out.append(f"{key.path}: unknown key, ignored{hint}")
    return out


def _codes_with_ok(path: str, raw: Any, what: str) -> list[str]:
    if not isinstance(raw, list):
        return []
    out = []
    for k, code in enumerate(raw):
        is_ok = (code == 0 and not isinstance(code, bool)) or (
            isinstance(code, str) and STATUS_BY_NAME.get(code.upper()) == 0
        )
        if is_ok:
            out.append(f"{path}[{k}]: OK is not a failure; listing it among {what} has no effect")
    return out


def _int_above(value: Any, cap: int) -> bool:
    """An int above ``cap`` that the config still accepts (an int32: larger ones are
    refused outright, with their own error, not "treated as" the cap)."""
    return isinstance(value, int) and not isinstance(value, bool) and cap < value <= 2**31 - 1


def lint(obj: Any, cap: int = DEFAULT_MAX_ATTEMPTS_CAP) -> list[str]:
    """Warnings for a decoded service config: what parses but is almost surely a mistake."""
    if not isinstance(obj, Mapping):
        return []
    out = _unknown_keys("", obj, ROOT)
    mcs = obj.get("methodConfig")
    for i, mc in enumerate(mcs if isinstance(mcs, list) else []):
        path = f"methodConfig[{i}]"
        if not isinstance(mc, Mapping):
            continue
        out += _unknown_keys(path, mc, METHOD)
        names = mc.get("name")
        if names is None or names == []:
            out.append(
                f"{path}: no name, so it applies to no method; "
                'name [{"service": "pkg.Svc"}] for a service, [{}] for every method'
            )
        for j, name in enumerate(names if isinstance(names, list) else []):
            if isinstance(name, Mapping):
                out += _unknown_keys(f"{path}.name[{j}]", name, NAME)
        for key, known, codes_key, what in (
            ("retryPolicy", RETRY, "retryableStatusCodes", "the retryable codes"),
            ("hedgingPolicy", HEDGING, "nonFatalStatusCodes", "the non-fatal codes"),
        ):
            policy = mc.get(key)
            if not isinstance(policy, Mapping):
                continue
            ppath = f"{path}.{key}"
            out += _unknown_keys(ppath, policy, known)
            out += _codes_with_ok(f"{ppath}.{codes_key}", policy.get(codes_key), what)
            attempts = policy.get("maxAttempts")
            if _int_above(attempts, cap):
                out.append(
                    f"{ppath}.maxAttempts: {attempts} is above the client cap of {cap}: "
                    f"treated as {cap}"
                )
        retry = mc.get("retryPolicy")
        if isinstance(retry, Mapping):
            out += _backoff_order(f"{path}.retryPolicy", retry)
            if "perAttemptRecvTimeout" in retry:
                out.append(
                    f"{path}.retryPolicy.perAttemptRecvTimeout: not supported by sdkcore "
                    "channels, ignored (an attempt ends with the call's timeout); see "
                    'rfc/0003, "Not done here"'
                )
        hedging = mc.get("hedgingPolicy")
        if isinstance(hedging, Mapping):
            out += _hedge_after_timeout(f"{path}.hedgingPolicy", hedging, mc.get("timeout"))
    throttling = obj.get("retryThrottling")
    if isinstance(throttling, Mapping):
        out += _unknown_keys("retryThrottling", throttling, THROTTLING)
    return out


def _hedge_after_timeout(path: str, hedging: Mapping[str, Any], timeout: Any) -> list[str]:
    """hedgingDelay at or past the method's timeout: the deadline ends the call before the
    first hedge is due (A6: the timeout bounds the whole call, every copy included)."""
    from .grpc._duration import parse_duration

    if "hedgingDelay" not in hedging or timeout is None:
        return []
    try:
        delay = parse_duration(hedging["hedgingDelay"])
        limit = parse_duration(timeout)
    except (ValueError, TypeError):
        return []  # reported as an error
    if 0 < limit <= delay:  # "0s" is no timeout, as grpc reads it
        return [
            f"{path}.hedgingDelay: {hedging['hedgingDelay']} is not below the method's timeout "
            f"{timeout}: the call's deadline comes first, so no hedge is ever sent"
        ]
    return []


def _backoff_order(path: str, retry: Mapping[str, Any]) -> list[str]:
    from .grpc._duration import parse_duration

    try:
        initial = parse_duration(retry.get("initialBackoff"))
        maximum = parse_duration(retry.get("maxBackoff"))
    except (ValueError, TypeError):
        return []  # reported as an error
    if initial > maximum > 0:
        return [
            f"{path}.initialBackoff: {retry['initialBackoff']} is above maxBackoff "
            f"{retry['maxBackoff']}: every backoff is capped at maxBackoff"
        ]
    return []


# -- summary --------------------------------------------------------------------------------


def _seconds(delay: timedelta) -> str:
    return f"{delay.total_seconds():g}s"


def _codes(codes: frozenset[int]) -> str:
    """The codes that take effect: OK never fails, so listing it changes nothing (a warning
    says so); "none" when no other code is listed."""
    return ", ".join(status_name(c) for c in sorted(codes) if c != _OK) or "none"


_OK = STATUS_BY_NAME["OK"]


def _names(names: tuple[MethodName, ...]) -> str:
    if not names:
        return "(no method)"
    parts = []
    for name in names:
        if not name.service:
            parts.append("(every method)")
        elif not name.method:
            parts.append(f"{name.service}/*")
        else:
            parts.append(f"{name.service}/{name.method}")
    return ", ".join(parts)


def _attempts(configured: int, cap: int) -> str:
    """``"3 attempts"``, or ``"5 attempts (configured 7, cap 5)"`` when the cap clamps it."""
    if configured <= cap:
        return f"{configured} attempts"
    return f"{cap} attempts (configured {configured}, cap {cap})"


def _policy(mc: MethodConfig, cap: int) -> str:
    parts = []
    retry = mc.retry_policy
    if retry is not None:
        if retry.initial_backoff >= retry.max_backoff:
            # every backoff is capped: the one actually used, not a growth that never happens
            backoff = (
                f"backoff {_seconds(retry.max_backoff)} every retry "
                f"(initialBackoff {_seconds(retry.initial_backoff)} capped by maxBackoff)"
            )
        else:
            backoff = (
                f"backoff {_seconds(retry.initial_backoff)}, "
                f"x{retry.backoff_multiplier:g} per retry, at most {_seconds(retry.max_backoff)}"
            )
        parts.append(
            f"retry: {_attempts(retry.max_attempts, cap)}; {backoff} "
            f"(jittered); retry on {_codes(retry.retryable_status_codes)}"
        )
    hedging = mc.hedging_policy
    if hedging is not None:
        parts.append(
            f"hedging: {_attempts(hedging.max_attempts, cap)}, "
            f"{_seconds(hedging.hedging_delay)} apart; "
            f"non-fatal: {_codes(hedging.non_fatal_status_codes)}"
        )
    if retry is None and hedging is None:
        parts.append("no retries (transparent retries only)")
    parts.append(f"timeout {_seconds(mc.timeout)}" if mc.timeout is not None else "no timeout")
    if mc.wait_for_ready is not None:
        parts.append(f"waitForReady {str(mc.wait_for_ready).lower()}")
    return "; ".join(parts)


def summary(config: ServiceConfig, cap: int = DEFAULT_MAX_ATTEMPTS_CAP) -> list[tuple[str, str]]:
    """(methods, effective policy) for each methodConfig, in file order."""
    return [(_names(mc.names), _policy(mc, cap)) for mc in config.method_configs]


# -- the command ----------------------------------------------------------------------------


_BOM = b"\xef\xbb\xbf"


def _read(file: str) -> str:
    """The file's text: UTF-8, a leading BOM dropped; anything else is a UsageError.

    stdin is read as bytes when it can be, so its decoding does not depend on
    ``PYTHONIOENCODING`` or the locale (a strict UTF-8 stdin would raise on the
    first bad byte).
    """
    source = "stdin" if file == "-" else printable(file)
    try:
        if file == "-":
            buffer = getattr(sys.stdin, "buffer", None)
            data: bytes | str = buffer.read() if buffer is not None else sys.stdin.read()
        else:
            with open(file, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # a text stdin without a buffer
        raise UsageError(f"{source} is not UTF-8 text: {exc.reason}") from None
    if isinstance(data, str):
        return data[1:] if data.startswith("\ufeff") else data
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{source} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason}); a service config is JSON, which is UTF-8"
        ) from None


def _decode(text: str) -> Any:
    """The decoded JSON, or None when it is not JSON (from_json then says why)."""
    try:
        return json.loads(text, parse_int=parse_int)
    except (ValueError, RecursionError):
        return None


def _wrap(text: str) -> str:
    """One message for stderr: control characters from the file escaped, then wrapped."""
    return textwrap.fill(printable(text), WIDTH, subsequent_indent="    ", break_on_hyphens=False)


def run(args: argparse.Namespace, out: Output) -> int:
    cap = args.max_attempts_cap
    if cap < 1:  # as the channels' max_attempts_cap (1: no retries, no hedges)
        raise UsageError(f"--max-attempts-cap must be an integer >= 1, got {cap}")
    text = _read(args.file)
    source = "stdin" if args.file == "-" else printable(args.file)
    err = sys.stderr
    if not text.strip():
        err.write(
            _wrap(
                f"{source}: empty: no gRPC service config to check (expected a JSON object, "
                'e.g. {"methodConfig": [...]})'
            )
            + "\n"
        )
        return 1
    obj: Any = _decode(text)
    warnings = lint(obj, cap)
    for warning in warnings:
        err.write(_wrap(f"warning: {warning}") + "\n")
    try:
        # Not JSON, or not an object: from_json reports it in the parser's words.
        config = ServiceConfig.from_json(obj if isinstance(obj, Mapping) else text)
    except ServiceConfigError as exc:
        n = len(exc.violations)
        err.write(
            _wrap(f"{source}: invalid gRPC service config ({n} problem{'s' if n != 1 else ''}):")
            + "\n"
        )
        for violation in exc.violations:
            err.write(_wrap(f"  {violation}") + "\n")
        return 1
    n = len(config.method_configs)
    out.heading(f"{source}: valid gRPC service config, {n} methodConfig{'s' if n != 1 else ''}")
    if warnings:
        out.line(f"  ({len(warnings)} warning{'s' if len(warnings) != 1 else ''} on stderr)")
    if config.method_configs:
        out.line()
        rows = [(printable(names), policy) for names, policy in summary(config, cap)]
        out.table(("methods", "effective policy"), rows)
    throttling = config.retry_throttling
    out.line()
    if throttling is None:
        out.line("retry throttling: off")
    else:
        out.line(
            f"retry throttling: maxTokens {throttling.max_tokens}, tokenRatio "
            f"{throttling.token_ratio:g}: retries and hedges stop while the tokens are at or "
            f"below {throttling.max_tokens / 2:g}; a failure takes 1 token, a success gives "
            f"{throttling.token_ratio:g} back"
        )
    return 0
