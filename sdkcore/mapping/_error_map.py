"""The KV error map (SDK RFC 0013 / 0069; RFC 0049 "KV Error Map Handling").

A server sends the error map after HELLO(XERROR) in reply to GET_ERROR_MAP. It is
JSON::

    {"version": 2, "revision": 1,
     "errors": {"86": {"name": "ETMPFAIL", "desc": "...", "attrs": ["temp", "retry-later"],
                       "retry": {"strategy": "exponential", "interval": 2, "after": 10,
                                 "ceil": 500, "max-duration": 1500}}}}

``errors`` is keyed by the status in hex (lower case, no ``0x``). sdkcore uses the
map for one decision only: a status it does not know, whose entry carries the
``retry-now`` or ``retry-later`` attribute, is handed to the orchestrator as
``KV_ERROR_MAP_RETRY_INDICATED``. The ``retry`` spec is parsed and its delays can
be computed (:meth:`RetrySpec.delay`), but per RFC 0049 it never overrides the
user's retry strategy.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import attrs
from attrs import field as _attrs_field

from .._untrusted import LongInt as _LongInt
from .._untrusted import parse_int as _parse_int
from .._untrusted import show as _show

__all__ = [
    "RETRY_ATTRIBUTES",
    "ErrorCode",
    "ErrorMap",
    "ErrorMapError",
    "RetrySpec",
    "RetrySpecStrategy",
]

#: The attributes that make an unknown status retryable (RFC 0049).
RETRY_ATTRIBUTES = frozenset({"retry-now", "retry-later"})

# Delays are clamped here so exponential specs cannot overflow timedelta (~3.3e6 years).
_MAX_DELAY_MS = 2**53


class ErrorMapError(ValueError):
    """The error map JSON is malformed. ``path`` names the offending field.

    ``str(exc)`` reads like ``errors["86"].retry.strategy: must be one of
    constant, linear, exponential, got 'foo'``.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else f"error map: {problem}")


class RetrySpecStrategy(enum.Enum):
    CONSTANT = "constant"
    LINEAR = "linear"
    EXPONENTIAL = "exponential"


def _check_strategy(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, RetrySpecStrategy):
        raise TypeError(
            f"RetrySpec.{attribute.name} must be a RetrySpecStrategy "
            f"(CONSTANT, LINEAR or EXPONENTIAL), got {_show(value)}"
        )


def _check_ms(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"RetrySpec.{attribute.name} must be an int number of milliseconds, got {_show(value)}"
        )
    if value < 0:
        raise ValueError(f"RetrySpec.{attribute.name} must be >= 0, got {_show(value)}")


@attrs.frozen(slots=True)
class RetrySpec:
    """An error map ``retry`` object. All durations are integer milliseconds.

    Informational only: sdkcore's strategies never use it (RFC 0049). Built
    directly, it validates its fields: ``strategy`` must be a
    :class:`RetrySpecStrategy` (TypeError otherwise) and every duration a
    non-negative int (TypeError for another type, ValueError when negative).
    """

    strategy: RetrySpecStrategy = attrs.field(validator=_check_strategy)
    interval_ms: int = attrs.field(validator=_check_ms, repr=_show)
    after_ms: int = attrs.field(validator=_check_ms, repr=_show)
    ceil_ms: int = attrs.field(default=0, validator=_check_ms, repr=_show)
    max_duration_ms: int = attrs.field(default=0, validator=_check_ms, repr=_show)

    def delay_ms(self, attempt: int) -> int:
        """The delay before retry ``attempt`` (0-based) in milliseconds.

        Attempt 0 waits ``after``. Attempt n >= 1 waits ``interval`` (constant),
        ``interval * n`` (linear) or ``interval ** n`` (exponential), capped at
        ``ceil`` when ``ceil > 0``. Every result, ``after`` included, is clamped
        at 2^53 ms so :meth:`delay` never overflows ``timedelta``.
        """
        if isinstance(attempt, bool) or not isinstance(attempt, int):
            raise TypeError(f"RetrySpec.delay(attempt) must be an int, got {_show(attempt)}")
        if attempt < 0:
            raise ValueError(f"RetrySpec.delay(attempt) must be >= 0, got {_show(attempt)}")
        if attempt == 0:
            return min(self.after_ms, _MAX_DELAY_MS)
        strategy = self.strategy
        if strategy is RetrySpecStrategy.CONSTANT:
            ms = self.interval_ms
        elif strategy is RetrySpecStrategy.LINEAR:
            ms = self.interval_ms * attempt
        else:
            # interval >= 2 passes _MAX_DELAY_MS by exponent 54; 0 and 1 are fixed points.
            ms = self.interval_ms ** min(attempt, 64)
        if self.ceil_ms > 0 and ms > self.ceil_ms:
            ms = self.ceil_ms
        return min(ms, _MAX_DELAY_MS)

    def delay(self, attempt: int) -> timedelta:
        """:meth:`delay_ms` as a ``timedelta``."""
        return timedelta(milliseconds=self.delay_ms(attempt))


def _check_int(low: int, high: int | None) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        what = f"{type(instance).__name__}.{attribute.name}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {_show(value)}")
        if value < low or (high is not None and value > high):
            allowed = f">= {low}" if high is None else f"in {low}..0x{high:x}"
            raise ValueError(f"{what} must be {allowed}, got {_show(value)}")

    return check


def _check_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name} must be a str, got {_show(value)}"
        )


def _to_attrs(value: object) -> frozenset[str]:
    """``ErrorCode.attrs``: an iterable of str (a list, set, frozenset...), not one str."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(
            "ErrorCode.attrs must be an iterable of str attribute names "
            f'(e.g. frozenset({{"retry-now"}})), got {_show(value)}'
        )
    try:
        items = frozenset(value)
    except TypeError:  # an unhashable item (the iterable may be one-shot: show it whole)
        raise TypeError(
            f"ErrorCode.attrs must hold only str attribute names, got {_show(value)}"
        ) from None
    for item in items:
        if not isinstance(item, str):
            raise TypeError(
                f"ErrorCode.attrs must hold only str attribute names, got {_show(item)} "
                f"({type(item).__name__})"
            )
    return items


def _check_retry(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, RetrySpec):
        raise TypeError(
            f"ErrorCode.retry must be an sdkcore.mapping.RetrySpec or None, got {_show(value)}"
        )


@attrs.frozen(slots=True)
class ErrorCode:
    """One entry of the error map. ``code`` is the KV status (0..0xffff).

    ``attrs`` is an iterable of str (stored as a frozenset; a single str is refused,
    not split into characters) and ``retry`` a :class:`RetrySpec` or None.
    """

    code: int = attrs.field(validator=_check_int(0, 0xFFFF))
    name: str = attrs.field(validator=_check_str)
    desc: str = attrs.field(validator=_check_str)
    attrs: frozenset[str] = attrs.field(converter=_to_attrs)
    # (the ``attrs`` field above shadows the module in this class body)
    retry: RetrySpec | None = _attrs_field(default=None, validator=_check_retry)

    @property
    def retry_indicated(self) -> bool:
        """True when the entry has the ``retry-now`` or ``retry-later`` attribute."""
        return not RETRY_ATTRIBUTES.isdisjoint(self.attrs)


def _check_errors(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(
            "ErrorMap.errors must be a mapping of KV status (int) -> sdkcore.mapping.ErrorCode, "
            f"got {_show(value)}"
        )
    for status, entry in value.items():
        if isinstance(status, bool) or not isinstance(status, int):
            raise TypeError(
                f"ErrorMap.errors keys must be int KV statuses, got {_show(status)} "
                f"({type(status).__name__})"
            )
        if not isinstance(entry, ErrorCode):
            raise TypeError(
                f"ErrorMap.errors[{_show(status)}] must be an sdkcore.mapping.ErrorCode, "
                f"got {_show(entry)}"
            )
        if entry.code != status:
            raise ValueError(
                f"ErrorMap.errors[{_show(status)}] holds the entry for status "
                f"0x{entry.code:x}: each key must be its entry's code"
            )


@attrs.frozen(slots=True, eq=False)
class ErrorMap:
    """A parsed KV error map. Build it with :meth:`from_json`."""

    version: int = attrs.field(validator=_check_int(1, None))
    revision: int = attrs.field(validator=_check_int(0, None))
    errors: Mapping[int, ErrorCode] = attrs.field(validator=_check_errors)
    #: Statuses whose entry indicates a retry (precomputed for the hot path).
    retry_statuses: frozenset[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(
            self,
            "retry_statuses",
            frozenset(code for code, entry in self.errors.items() if entry.retry_indicated),
        )

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview | str) -> ErrorMap:
        """Parse and validate the GET_ERROR_MAP payload.

        Raises :class:`ErrorMapError` (a ValueError) naming the JSON path of the
        first problem. Unknown keys are ignored so newer map versions still parse.
        """
        if isinstance(data, (bytes, bytearray, memoryview)):
            try:
                text = bytes(data).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ErrorMapError("", f"is not valid UTF-8 ({exc})") from None
        elif isinstance(data, str):
            text = data
        else:
            raise TypeError(
                f"ErrorMap.from_json(data) takes bytes or str, got {type(data).__name__}"
            )
        try:
            doc = json.loads(text, parse_int=_parse_int)
        except json.JSONDecodeError as exc:
            raise ErrorMapError(
                "", f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        except RecursionError:
            raise ErrorMapError(
                "", "is not a usable JSON document: arrays/objects nest too deeply to decode"
            ) from None
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: Any) -> ErrorMap:
        """Validate an already-decoded error map (see :meth:`from_json`)."""
        if not isinstance(doc, dict):
            raise ErrorMapError("", f"must be a JSON object, got {_json_type(doc)}")
        version = _int(doc, "version", "version", minimum=1)
        revision = _int(doc, "revision", "revision", minimum=0)
        raw_errors = doc.get("errors", _MISSING)
        if raw_errors is _MISSING:
            raise ErrorMapError("errors", "is required")
        if not isinstance(raw_errors, dict):
            raise ErrorMapError("errors", f"must be an object, got {_json_type(raw_errors)}")
        errors: dict[int, ErrorCode] = {}
        for key, raw in raw_errors.items():
            path = f"errors[{json.dumps(key) if isinstance(key, str) else repr(key)}]"
            code = _status_key(key, path)
            if code in errors:
                raise ErrorMapError(path, f"duplicates status 0x{code:x} (another key spells it)")
            errors[code] = _entry(code, raw, path)
        return cls(version, revision, MappingProxyType(errors))

    def get(self, status: int) -> ErrorCode | None:
        """The entry for ``status``, or None."""
        return self.errors.get(status)

    def retry_indicated(self, status: int) -> bool:
        """True when ``status`` has an entry with ``retry-now`` or ``retry-later``."""
        return status in self.retry_statuses

    def __len__(self) -> int:
        return len(self.errors)

    def __iter__(self) -> Iterator[ErrorCode]:
        return iter(self.errors.values())

    def __repr__(self) -> str:
        return (
            f"<ErrorMap version={_show(self.version)} revision={_show(self.revision)} "
            f"entries={len(self.errors)}>"
        )


# -- validation helpers ------------------------------------------------------------

_MISSING: Any = object()
_STRATEGIES = {s.value: s for s in RetrySpecStrategy}


def _json_type(value: Any) -> str:
    if isinstance(value, _LongInt):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _int(obj: dict[str, Any], key: str, path: str, *, minimum: int, default: Any = _MISSING) -> int:
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ErrorMapError(path, "is required")
        return int(default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ErrorMapError(path, f"must be an integer, got {_json_type(value)} {_show(value)}")
    if value < minimum:
        raise ErrorMapError(path, f"must be >= {minimum}, got {_show(value)}")
    return value


def _str(obj: dict[str, Any], key: str, path: str) -> str:
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        raise ErrorMapError(path, "is required")
    if not isinstance(value, str):
        raise ErrorMapError(path, f"must be a string, got {_json_type(value)} {_show(value)}")
    return value


def _status_key(key: object, path: str) -> int:
    if not isinstance(key, str):
        raise ErrorMapError(path, f"key must be a lower-case hex string, got {type(key).__name__}")
    if not key or len(key) > 4 or any(c not in "0123456789abcdefABCDEF" for c in key):
        raise ErrorMapError(path, 'key must be a KV status in hex (1 to 4 hex digits, e.g. "86")')
    return int(key, 16)


def _entry(code: int, raw: Any, path: str) -> ErrorCode:
    if not isinstance(raw, dict):
        raise ErrorMapError(path, f"must be an object, got {_json_type(raw)}")
    name = _str(raw, "name", f"{path}.name")
    desc = _str(raw, "desc", f"{path}.desc")
    raw_attrs = raw.get("attrs", _MISSING)
    if raw_attrs is _MISSING:
        raise ErrorMapError(f"{path}.attrs", "is required")
    if not isinstance(raw_attrs, list):
        raise ErrorMapError(f"{path}.attrs", f"must be an array, got {_json_type(raw_attrs)}")
    for i, attr in enumerate(raw_attrs):
        if not isinstance(attr, str):
            raise ErrorMapError(
                f"{path}.attrs[{i}]", f"must be a string, got {_json_type(attr)} {_show(attr)}"
            )
    retry = None
    raw_retry = raw.get("retry", _MISSING)
    if raw_retry is not _MISSING:
        retry = _retry_spec(raw_retry, f"{path}.retry")
    return ErrorCode(code, name, desc, frozenset(raw_attrs), retry)


def _retry_spec(raw: Any, path: str) -> RetrySpec:
    if not isinstance(raw, dict):
        raise ErrorMapError(path, f"must be an object, got {_json_type(raw)}")
    strategy_name = raw.get("strategy", _MISSING)
    if strategy_name is _MISSING:
        raise ErrorMapError(f"{path}.strategy", "is required")
    strategy = _STRATEGIES.get(strategy_name) if isinstance(strategy_name, str) else None
    if strategy is None:
        raise ErrorMapError(
            f"{path}.strategy",
            f"must be one of constant, linear, exponential, got {_show(strategy_name)}",
        )
    return RetrySpec(
        strategy=strategy,
        interval_ms=_int(raw, "interval", f"{path}.interval", minimum=0),
        after_ms=_int(raw, "after", f"{path}.after", minimum=0),
        ceil_ms=_int(raw, "ceil", f"{path}.ceil", minimum=0, default=0),
        max_duration_ms=_int(raw, "max-duration", f"{path}.max-duration", minimum=0, default=0),
    )
