"""The gRPC service config, as far as A6 (retries, hedging, throttling) needs it.

Pure Python: parsing and validation never import grpc. Every violation is
collected (with its JSON path and what is allowed) before
:class:`ServiceConfigError` is raised, so one error shows everything to fix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

import attrs

from .._hedge_policy import DEFAULT_HEDGE_ATTEMPTS_CAP
from .._untrusted import LongInt as _LongInt
from .._untrusted import parse_int as _parse_int
from .._untrusted import show as _show
from ._duration import parse_duration
from ._ignored_keys import IgnoredKey, ignored_keys
from ._status import STATUS_BY_NAME, STATUS_NAMES

__all__ = [
    "DEFAULT_MAX_ATTEMPTS_CAP",
    "HedgingPolicy",
    "MethodConfig",
    "MethodName",
    "RetryPolicy",
    "RetryThrottlingPolicy",
    "ServiceConfig",
    "ServiceConfigError",
    "ServiceConfigViolation",
]

#: A6 "Limits on Retries and Hedges": the client-side cap on maxAttempts, one for retries
#: and hedges (written once, in the core's hedge policy).
DEFAULT_MAX_ATTEMPTS_CAP = DEFAULT_HEDGE_ATTEMPTS_CAP
_MAX_TOKENS_LIMIT = 1000
#: maxAttempts is an int32 in grpc's service config (proto3 JSON).
_INT32_MAX = 2**31 - 1


@attrs.frozen(slots=True)
class ServiceConfigViolation:
    """One problem in a service config: where (a JSON path) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '(root)'}: {self.message}"


class ServiceConfigError(ValueError):
    """The service config is invalid; ``violations`` lists every problem found."""

    def __init__(
        self, violations: list[ServiceConfigViolation] | tuple[ServiceConfigViolation, ...]
    ):
        self.violations: tuple[ServiceConfigViolation, ...] = tuple(violations)
        n = len(self.violations)
        lines = "\n".join(f"  {v}" for v in self.violations)
        super().__init__(
            f"invalid gRPC service config ({n} problem{'s' if n != 1 else ''}):\n{lines}"
        )


# -- checks of the value classes (a config built by hand gets the parser's rules) ------
def _where(inst: Any, attribute: Any) -> str:
    return f"{type(inst).__name__}({attribute.name})"


def _shown(value: Any) -> str:
    """A bounded repr (see ``sdkcore._untrusted.show``)."""
    return _show(value)


def _attempts(inst: Any, attribute: Any, value: Any) -> None:
    if not _is_int(value):
        raise TypeError(f"{_where(inst, attribute)} must be an int >= 2, got {_shown(value)}")
    if value < 2:
        raise ValueError(f"{_where(inst, attribute)} must be an int >= 2, got {_shown(value)}")
    if value.bit_length() > 10_000:  # its repr would exceed CPython's int digit limit
        raise ValueError(f"{_where(inst, attribute)} must be an int >= 2, got one too large")


def _finite_positive(inst: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{_where(inst, attribute)} must be a finite number > 0, got {_shown(value)}"
        )
    if not _is_number(value) or value <= 0:
        raise ValueError(
            f"{_where(inst, attribute)} must be a finite number > 0, got {_shown(value)}"
        )


def _duration(*, positive: bool) -> Any:
    def check(inst: Any, attribute: Any, value: Any) -> None:
        allowed = "> 0" if positive else ">= 0"
        if not isinstance(value, timedelta):
            raise TypeError(
                f"{_where(inst, attribute)} must be a datetime.timedelta {allowed}, "
                f"got {_shown(value)}"
            )
        if value < timedelta(0) or (positive and value == timedelta(0)):
            raise ValueError(f"{_where(inst, attribute)} must be {allowed}, got {_shown(value)}")

    return check


def _codes(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, frozenset) or not all(_is_int(c) and 0 <= c <= 16 for c in value):
        raise TypeError(
            f"{_where(inst, attribute)} must be a frozenset of status numbers 0-16, "
            f"got {_shown(value)}"
        )


def _max_tokens(inst: Any, attribute: Any, value: Any) -> None:
    if not _is_int(value):
        raise TypeError(
            f"{_where(inst, attribute)} must be an int in (0, {_MAX_TOKENS_LIMIT}], "
            f"got {_shown(value)}"
        )
    if not 0 < value <= _MAX_TOKENS_LIMIT:
        raise ValueError(
            f"{_where(inst, attribute)} must be an int in (0, {_MAX_TOKENS_LIMIT}], "
            f"got {_shown(value)}"
        )


def _token_ratio(inst: Any, attribute: Any, value: Any) -> None:
    _finite_positive(inst, attribute, value)
    if value > 1_000_000 or value < 0.001:
        raise ValueError(
            f"{_where(inst, attribute)} must be in [0.001, 1000000], got {_shown(value)}"
        )


def _name_part(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f'{_where(inst, attribute)} must be a str ("" for every one), got {_shown(value)}'
        )


@attrs.frozen(slots=True)
class MethodName:
    """A ``methodConfig[].name[]`` entry: empty service means "every method" (the default).

    ``service`` (``"pkg.Service"``) and ``method`` (``"Method"``) are str.
    """

    service: str = attrs.field(default="", validator=_name_part)
    method: str = attrs.field(default="", validator=_name_part)


@attrs.frozen(slots=True)
class RetryPolicy:
    """A6 ``retryPolicy``. ``max_attempts`` is the configured value (not yet capped).

    Durations are ``timedelta`` values: nanosecond inputs are rounded up to the
    next whole microsecond (``"0.0000004s"`` is 1 µs), so a duration > 0 stays > 0.
    """

    max_attempts: int = attrs.field(validator=_attempts)
    initial_backoff: timedelta = attrs.field(validator=_duration(positive=True))
    max_backoff: timedelta = attrs.field(validator=_duration(positive=True))
    backoff_multiplier: float = attrs.field(validator=_finite_positive)
    retryable_status_codes: frozenset[int] = attrs.field(validator=_codes)

    def effective_max_attempts(self, cap: int = DEFAULT_MAX_ATTEMPTS_CAP) -> int:
        """``min(max_attempts, cap)``: values above the client cap are treated as the cap."""
        return min(self.max_attempts, cap)


@attrs.frozen(slots=True)
class HedgingPolicy:
    """A6 ``hedgingPolicy``: run by the channel helpers for unary-unary calls (rfc/0004,
    ``sdkcore.grpc._hedging``); the streaming calls of such a method are not hedged."""

    max_attempts: int = attrs.field(validator=_attempts)
    hedging_delay: timedelta = attrs.field(
        default=timedelta(0), validator=_duration(positive=False)
    )
    non_fatal_status_codes: frozenset[int] = attrs.field(default=frozenset(), validator=_codes)

    def effective_max_attempts(self, cap: int = DEFAULT_MAX_ATTEMPTS_CAP) -> int:
        return min(self.max_attempts, cap)


@attrs.frozen(slots=True)
class RetryThrottlingPolicy:
    """A6 ``retryThrottling``; ``token_ratio`` is already truncated to 3 decimals."""

    max_tokens: int = attrs.field(validator=_max_tokens)
    token_ratio: float = attrs.field(validator=_token_ratio)


@attrs.frozen(slots=True)
class MethodConfig:
    """One ``methodConfig`` entry."""

    names: tuple[MethodName, ...]
    retry_policy: RetryPolicy | None = None
    hedging_policy: HedgingPolicy | None = None
    timeout: timedelta | None = None
    wait_for_ready: bool | None = None


def _split_method(full_method: str) -> tuple[str, str]:
    # "/pkg.Service/Method" -> ("pkg.Service", "Method")
    path = full_method[1:] if full_method.startswith("/") else full_method
    service, _, method = path.partition("/")
    return service, method


@attrs.frozen(slots=True)
class ServiceConfig:
    """A parsed, validated service config. Build it with :meth:`from_json`."""

    method_configs: tuple[MethodConfig, ...] = ()
    retry_throttling: RetryThrottlingPolicy | None = None
    #: What grpc C-core applies itself, as JSON (None: nothing): the config without the
    #: parts sdkcore runs (retryPolicy, hedgingPolicy, timeout, waitForReady,
    #: retryThrottling), i.e. ``loadBalancingConfig``/``loadBalancingPolicy``,
    #: ``healthCheckConfig`` and each method's ``maxRequestMessageBytes``/
    #: ``maxResponseMessageBytes`` (rfc/0003, "What grpc C-core still applies").
    for_grpc: str | None = attrs.field(default=None, eq=False, repr=False)
    #: The keys :meth:`from_json` found and ignored (A6: unknown keys are ignored), each
    #: with its JSON path and the key probably meant: what a channel made with this
    #: config logs, once, as ``grpc.config_ignored`` (rfc/0003, "Config events").
    _ignored: tuple[IgnoredKey, ...] = attrs.field(default=(), eq=False, repr=False)
    _index: Mapping[MethodName, MethodConfig] = attrs.field(
        default=attrs.Factory(lambda self: _index_of(self.method_configs), takes_self=True),
        eq=False,
        repr=False,
    )

    @classmethod
    def from_json(cls, data: str | bytes | bytearray | Mapping[str, Any]) -> ServiceConfig:
        """Parse and validate; raises :class:`ServiceConfigError` listing every violation."""
        if isinstance(data, (str, bytes, bytearray)):
            try:
                obj: Any = json.loads(data, parse_int=_parse_int)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ServiceConfigError(
                    [
                        ServiceConfigViolation(
                            "", f"must be a JSON object; the text is not JSON: {exc}"
                        )
                    ]
                ) from None
            except RecursionError:
                raise ServiceConfigError(
                    [
                        ServiceConfigViolation(
                            "",
                            "must be a JSON object; the text nests arrays/objects too deeply "
                            "to decode",
                        )
                    ]
                ) from None
        elif isinstance(data, Mapping):
            obj = data
        else:
            raise TypeError(
                "ServiceConfig.from_json(data) takes a JSON str/bytes or a Mapping, "
                f"got {type(data).__name__}"
            )
        return _Parser().parse(obj)

    def method_config(self, full_method: str) -> MethodConfig | None:
        """The config for ``"/pkg.Service/Method"``: exact match, then service, then default."""
        if not isinstance(full_method, str):
            raise TypeError(
                "ServiceConfig.method_config(full_method) must be a str, the full method "
                f'name ("/pkg.Service/Method"), got {_shown(full_method)}'
            )
        service, method = _split_method(full_method)
        index = self._index
        found = index.get(MethodName(service, method))
        if found is None:
            found = index.get(MethodName(service, ""))
            if found is None:
                found = index.get(MethodName("", ""))
        return found


def _index_of(configs: tuple[MethodConfig, ...]) -> Mapping[MethodName, MethodConfig]:
    out: dict[MethodName, MethodConfig] = {}
    for mc in configs:
        for name in mc.names:
            out.setdefault(name, mc)
    return out


_CODE_HELP = 'an integer 0..16 or a status name such as "UNAVAILABLE" (case-insensitive)'
#: What grpc's JSON loader reads as an integer or a number written as a string (proto3
#: JSON: an int32 or a double may be a JSON number or a string). Surrounding ASCII
#: whitespace is allowed, as absl::SimpleAtoi / SimpleAtod allow it.
_INT_TEXT = re.compile(r"[+-]?([0-9]+)")
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SPACE = " \t\n\v\f\r"


def _json_int(value: object) -> int | None:
    """``value`` as an integer, as proto3 JSON writes one: a JSON integer or a string of one.

    None when it is neither (a fraction, ``"3e10"``, ``"abc"``, a boolean, a JSON
    integer too long to hold). The caller checks the range.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip(_SPACE)
        match = _INT_TEXT.fullmatch(text)
        if match is None:
            return None
        digits = match.group(1).lstrip("0")
        if len(digits) > 20:  # past every int the fields hold; int() of it is never needed
            return None
        n = int(digits or "0")
        return -n if text[0] == "-" else n
    return None


def _json_number(value: object) -> Decimal | None:
    """``value`` as a finite decimal: a JSON number or a string of one (proto3 JSON double).

    None otherwise (``"NaN"``, ``"Infinity"``, ``"2x"``, a boolean, an integer too long
    to hold).
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip(_SPACE)
        if len(text) > 400 or _NUMBER_TEXT.fullmatch(text) is None:
            return None
    elif _is_number(value):
        text = repr(value)
    else:
        return None
    try:
        number = Decimal(text)
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimal text
        return None
    return number if number.is_finite() else None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    """A JSON number that is a finite float (a huge integer is not: it has no float value)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond the float range
        return False


#: The parts of a method config grpc C-core applies on an sdkcore channel.
_GRPC_METHOD_KEYS = ("maxRequestMessageBytes", "maxResponseMessageBytes")


def _for_grpc(obj: Mapping[str, Any]) -> str | None:
    """:attr:`ServiceConfig.for_grpc` of a valid config ``obj``."""
    rest = {k: v for k, v in obj.items() if k not in ("methodConfig", "retryThrottling")}
    methods = []
    for raw in obj.get("methodConfig") or ():
        sizes = {k: raw[k] for k in _GRPC_METHOD_KEYS if k in raw}
        if sizes and "name" in raw:
            methods.append({"name": raw["name"], **sizes})
    if methods:
        rest["methodConfig"] = methods
    return json.dumps(rest) if rest else None


class _Parser:
    def __init__(self) -> None:
        self.errors: list[ServiceConfigViolation] = []

    def err(self, path: str, message: str) -> None:
        self.errors.append(ServiceConfigViolation(path, message))

    def parse(self, obj: Any) -> ServiceConfig:
        if not isinstance(obj, Mapping):
            self.err("", f"must be a JSON object, got {_kind(obj)}")
            raise ServiceConfigError(self.errors)
        configs: list[MethodConfig] = []
        raw_mcs = obj.get("methodConfig")
        if raw_mcs is not None:
            if not isinstance(raw_mcs, list):
                self.err("methodConfig", f"must be an array of objects, got {_kind(raw_mcs)}")
            else:
                seen: dict[MethodName, str] = {}
                for i, raw in enumerate(raw_mcs):
                    mc = self.method_config(f"methodConfig[{i}]", raw, seen)
                    if mc is not None:
                        configs.append(mc)
        throttling = None
        if obj.get("retryThrottling") is not None:  # JSON null: unset, as in proto3
            throttling = self.throttling("retryThrottling", obj["retryThrottling"])
        if self.errors:
            raise ServiceConfigError(self.errors)
        return ServiceConfig(tuple(configs), throttling, _for_grpc(obj), ignored=ignored_keys(obj))

    # -- methodConfig -------------------------------------------------------------
    def method_config(
        self, path: str, raw: Any, seen: dict[MethodName, str]
    ) -> MethodConfig | None:
        if not isinstance(raw, Mapping):
            self.err(path, f"must be an object, got {_kind(raw)}")
            return None
        names = self.names(f"{path}.name", raw.get("name"), seen)
        # A field set to JSON null is unset (proto3 JSON), as grpc reads it.
        retry = hedging = None
        if raw.get("retryPolicy") is not None:
            retry = self.retry_policy(f"{path}.retryPolicy", raw["retryPolicy"])
        if raw.get("hedgingPolicy") is not None:
            hedging = self.hedging_policy(f"{path}.hedgingPolicy", raw["hedgingPolicy"])
        if raw.get("retryPolicy") is not None and raw.get("hedgingPolicy") is not None:
            self.err(
                path,
                "may set retryPolicy or hedgingPolicy, not both (A6: one policy per method)",
            )
        timeout = None
        if raw.get("timeout") is not None:
            timeout = self.duration(f"{path}.timeout", raw["timeout"], positive=False)
            if timeout is not None and not timeout:  # "0s": no timeout, as grpc reads it
                timeout = None
        wait_for_ready = raw.get("waitForReady")
        if wait_for_ready is not None and not isinstance(wait_for_ready, bool):
            self.err(f"{path}.waitForReady", f"must be true or false, got {_show(wait_for_ready)}")
            wait_for_ready = None
        return MethodConfig(tuple(names), retry, hedging, timeout, wait_for_ready)

    def names(self, path: str, raw: Any, seen: dict[MethodName, str]) -> list[MethodName]:
        if raw is None:
            return []
        if not isinstance(raw, list):
            self.err(path, f'must be an array of {{"service", "method"}} objects, got {_kind(raw)}')
            return []
        out: list[MethodName] = []
        for j, entry in enumerate(raw):
            p = f"{path}[{j}]"
            if not isinstance(entry, Mapping):
                self.err(
                    p, f'must be an object with optional "service" and "method", got {_kind(entry)}'
                )
                continue
            service = entry.get("service", "")
            method = entry.get("method", "")
            ok = True
            for key, value in (("service", service), ("method", method)):
                if not isinstance(value, str):
                    self.err(f"{p}.{key}", f"must be a string, got {_kind(value)}")
                    ok = False
            if not ok:
                continue
            if method and not service:
                self.err(
                    p,
                    f"method {_show(method)} needs a service "
                    "(an empty service is the default entry)",
                )
                continue
            name = MethodName(service, method)
            if name in seen:
                self.err(
                    p,
                    f"duplicate method name {_show(service)}/{_show(method)}, "
                    f"already used at {seen[name]}",
                )
                continue
            seen[name] = p
            out.append(name)
        return out

    # -- policies -----------------------------------------------------------------
    def max_attempts(self, path: str, raw: Mapping[str, Any]) -> int:
        if "maxAttempts" not in raw:
            self.err(f"{path}.maxAttempts", "is required: an integer >= 2")
            return 0
        v = raw["maxAttempts"]
        n = _json_int(v)
        if n is None or not 2 <= n <= _INT32_MAX:
            self.err(
                f"{path}.maxAttempts",
                f"must be an integer >= 2 and <= {_INT32_MAX} (an int32), written as a JSON "
                f'integer (no fraction) or a string of one (3 or "3"), got {_show(v)}',
            )
            return 0
        return n

    def retry_policy(self, path: str, raw: Any) -> RetryPolicy | None:
        if not isinstance(raw, Mapping):
            self.err(path, f"must be an object, got {_kind(raw)}")
            return None
        before = len(self.errors)
        attempts = self.max_attempts(path, raw)
        initial = maximum = None
        for key in ("initialBackoff", "maxBackoff"):
            p = f"{path}.{key}"
            if key not in raw:
                self.err(p, 'is required: a proto3 JSON duration > 0, e.g. "0.1s"')
                continue
            d = self.duration(p, raw[key], positive=True)
            if key == "initialBackoff":
                initial = d
            else:
                maximum = d
        multiplier = 0.0
        if "backoffMultiplier" not in raw:
            self.err(f"{path}.backoffMultiplier", "is required: a number > 0")
        else:
            v = raw["backoffMultiplier"]
            number = _json_number(v)
            as_float = 0.0 if number is None else float(number)
            if as_float <= 0.0 or not math.isfinite(as_float):
                self.err(
                    f"{path}.backoffMultiplier",
                    "must be a finite number > 0, written as a JSON number or a string of "
                    f'one (2 or "2"), got {_show(v)}',
                )
            else:
                multiplier = as_float
        codes: frozenset[int] = frozenset()
        p = f"{path}.retryableStatusCodes"
        if "retryableStatusCodes" not in raw:
            self.err(p, f"is required: a non-empty array of status codes ({_CODE_HELP})")
        else:
            codes = self.codes(p, raw["retryableStatusCodes"], non_empty=True)
        if len(self.errors) != before or initial is None or maximum is None:
            return None
        return RetryPolicy(attempts, initial, maximum, multiplier, codes)

    def hedging_policy(self, path: str, raw: Any) -> HedgingPolicy | None:
        if not isinstance(raw, Mapping):
            self.err(path, f"must be an object, got {_kind(raw)}")
            return None
        before = len(self.errors)
        attempts = self.max_attempts(path, raw)
        delay: timedelta | None = timedelta(0)
        if "hedgingDelay" in raw:
            delay = self.duration(f"{path}.hedgingDelay", raw["hedgingDelay"], positive=False)
        codes: frozenset[int] = frozenset()
        if "nonFatalStatusCodes" in raw:
            codes = self.codes(
                f"{path}.nonFatalStatusCodes", raw["nonFatalStatusCodes"], non_empty=False
            )
        if len(self.errors) != before or delay is None:
            return None
        return HedgingPolicy(attempts, delay, codes)

    def codes(self, path: str, raw: Any, *, non_empty: bool) -> frozenset[int]:
        if not isinstance(raw, list):
            self.err(path, f"must be an array of status codes ({_CODE_HELP}), got {_kind(raw)}")
            return frozenset()
        if non_empty and not raw:
            self.err(path, f"must not be empty: list at least one status code ({_CODE_HELP})")
            return frozenset()
        out: set[int] = set()
        for k, code in enumerate(raw):
            if _is_int(code) and 0 <= code < len(STATUS_NAMES):
                out.add(int(code))
            elif isinstance(code, str) and code.isascii() and code.upper() in STATUS_BY_NAME:
                # ASCII only: str.upper() maps look-alikes (a dotless i, U+0131) to real names
                out.add(STATUS_BY_NAME[code.upper()])
            else:
                self.err(
                    f"{path}[{k}]", f"must be a valid status code ({_CODE_HELP}), got {_show(code)}"
                )
        return frozenset(out)

    def duration(self, path: str, raw: Any, *, positive: bool) -> timedelta | None:
        try:
            nanos = parse_duration(raw)
        except ValueError as exc:
            self.err(path, str(exc))
            return None
        if positive and nanos <= 0:
            self.err(path, f"must be a duration > 0, got {_show(raw)}")
            return None
        if not positive and nanos < 0:
            self.err(path, f"must be a duration >= 0, got {_show(raw)}")
            return None
        # timedelta holds microseconds: round up, so a duration > 0 never becomes 0.
        return timedelta(microseconds=-(-nanos // 1000))

    # -- retryThrottling ----------------------------------------------------------
    def throttling(self, path: str, raw: Any) -> RetryThrottlingPolicy | None:
        if not isinstance(raw, Mapping):
            self.err(path, f"must be an object with maxTokens and tokenRatio, got {_kind(raw)}")
            return None
        before = len(self.errors)
        max_tokens = 0
        if "maxTokens" not in raw:
            self.err(f"{path}.maxTokens", f"is required: an integer in (0, {_MAX_TOKENS_LIMIT}]")
        else:
            v = raw["maxTokens"]
            n = _json_int(v)
            if n is None or not 0 < n <= _MAX_TOKENS_LIMIT:
                self.err(
                    f"{path}.maxTokens",
                    f"must be an integer in (0, {_MAX_TOKENS_LIMIT}], written as a JSON "
                    f'integer (no fraction) or a string of one (10 or "10"), got {_show(v)}',
                )
            else:
                max_tokens = n
        ratio = 0.0
        if "tokenRatio" not in raw:
            self.err(f"{path}.tokenRatio", "is required: a number > 0 (3 decimal places are used)")
        else:
            v = raw["tokenRatio"]
            number = _json_number(v)
            if number is None or number <= 0:
                self.err(
                    f"{path}.tokenRatio",
                    "must be a finite number > 0, written as a JSON number or a string of "
                    f'one (0.1 or "0.1"), got {_show(v)}',
                )
            elif number > 1_000_000:  # RetryThrottler's bound: a success refills any bucket
                self.err(f"{path}.tokenRatio", f"must be at most 1000000, got {_show(v)}")
            elif (milli := int(number * 1000)) == 0:
                self.err(
                    f"{path}.tokenRatio",
                    "must be at least 0.001 (digits past the third decimal are dropped), "
                    f"got {_show(v)}",
                )
            else:
                ratio = milli / 1000
        if len(self.errors) != before:
            return None
        return RetryThrottlingPolicy(max_tokens, ratio)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return f"string {_show(value)}"
    if isinstance(value, _LongInt):
        return repr(value)
    return f"{type(value).__name__} {_show(value)}"
