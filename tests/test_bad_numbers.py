"""Public constructors and entry points of sdkcore.mapping and sdkcore.testing with bad numbers.

Each either accepts the value (and its repr and str never raise) or rejects it with a
TypeError or ValueError that names the field: never OverflowError, never a message from
CPython's own conversions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from bad_numbers import judge

from sdkcore.mapping import (
    ErrorCode,
    ErrorMap,
    KvOpcode,
    RetrySpec,
    RetrySpecStrategy,
    grpc_code,
    grpc_failure,
    is_idempotent_kv,
    kv_exception,
    kv_failure,
    kv_request,
    kv_retry_reason,
    search_exception,
    search_retry_reason,
    views_retry_reason,
)
from sdkcore.testing import Delay, ScriptedSend, VirtualClock

BAD_NUMBERS: list[Any] = [
    float("inf"),
    float("-inf"),
    float("nan"),
    10**400,
    -(10**400),
    10**5000,  # past CPython's int-to-str limit: a naive repr raises
    True,
    False,
    1.5,
    -1,
    "3",
    None,
]

SPEC: dict[str, Any] = {"strategy": RetrySpecStrategy.CONSTANT, "interval_ms": 1, "after_ms": 1}


def _grpc_status(**kwargs: Any) -> Any:
    testing_grpc = pytest.importorskip("sdkcore.testing._grpc")
    return testing_grpc.GrpcStatus(**kwargs)


#: (field named in the error, build with the bad value)
FIELDS: list[tuple[str, Callable[[Any], object]]] = [
    ("Delay(seconds)", lambda v: Delay(v)),
    ("ScriptedSend(kv_opcode)", lambda v: ScriptedSend(["x"], kv_opcode=v)),
    ("ScriptedSend(read_only)", lambda v: ScriptedSend(["x"], read_only=v)),
    ("VirtualClock(start)", lambda v: VirtualClock(v)),
    ("VirtualClock.advance(seconds)", lambda v: VirtualClock().advance(v)),
    ("GrpcStatus(pushback_ms)", lambda v: _grpc_status(code=14, pushback_ms=v)),
    ("GrpcStatus(message)", lambda v: _grpc_status(code=14, message=v)),
    ("gRPC status code", lambda v: _grpc_status(code=v)),
    ("RetrySpec.interval_ms", lambda v: RetrySpec(**{**SPEC, "interval_ms": v})),
    ("RetrySpec.after_ms", lambda v: RetrySpec(**{**SPEC, "after_ms": v})),
    ("RetrySpec.ceil_ms", lambda v: RetrySpec(**{**SPEC, "ceil_ms": v})),
    ("RetrySpec.max_duration_ms", lambda v: RetrySpec(**{**SPEC, "max_duration_ms": v})),
    ("RetrySpec.delay(attempt)", lambda v: RetrySpec(**SPEC).delay(v)),
    ("ErrorCode.code", lambda v: ErrorCode(v, "X", "x", frozenset())),
    ("ErrorMap.version", lambda v: ErrorMap(v, 0, {})),
    ("ErrorMap.revision", lambda v: ErrorMap(1, v, {})),
    ("kv_retry_reason(status)", lambda v: kv_retry_reason(v, 0)),
    ("kv_retry_reason(opcode)", lambda v: kv_retry_reason(1, v)),
    ("kv_exception(status)", lambda v: kv_exception(v, 0)),
    ("kv_failure(status)", lambda v: kv_failure(v, KvOpcode.GET)),
    ("kv_failure(opcode)", lambda v: kv_failure(1, v)),
    ("is_idempotent_kv(opcode)", lambda v: is_idempotent_kv(v)),
    ("kv_request(opcode)", lambda v: kv_request(v)),
    ("gRPC status code", lambda v: grpc_code(v)),
    ("gRPC status code", lambda v: grpc_failure(v)),
    ("search_retry_reason(http_status)", lambda v: search_retry_reason(v)),
    ("search_exception(http_status)", lambda v: search_exception(v)),
    ("views_retry_reason(http_status)", lambda v: views_retry_reason(v)),
]


VALUE_IDS = ["inf", "-inf", "nan", "1e400", "-1e400", "1e5000", "True", "False", "1.5", "-1", "str"]
VALUE_IDS.append("None")


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=VALUE_IDS)
@pytest.mark.parametrize(("field", "build"), FIELDS, ids=[f for f, _ in FIELDS])
def test_bad_number_is_rejected_naming_the_field_or_accepted_with_a_safe_repr(
    field: str, build: Callable[[Any], object], value: Any
) -> None:
    judge(build, value, named=field)


def test_the_values_the_issue_names() -> None:
    with pytest.raises(ValueError, match=r"Delay\(seconds\) must be a finite number"):
        Delay(10**400)
    with pytest.raises(ValueError, match=r"Delay\(seconds\) must be a finite number"):
        Delay(float("inf"))
    with pytest.raises(TypeError, match=r"ScriptedSend\(kv_opcode\) must be an int"):
        ScriptedSend(["x"], kv_opcode=float("inf"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"VirtualClock\(start\) must be a finite"):
        VirtualClock(float("nan"))
    spec = RetrySpec(RetrySpecStrategy.CONSTANT, 10**5000, 1)
    assert "a 5001-digit integer" in repr(spec)
    error_map = ErrorMap(10**5000, 0, {})
    assert "version=a 5001-digit integer" in repr(error_map)
    assert repr(Delay(1.5)) == "Delay(seconds=1.5, then=None)"
