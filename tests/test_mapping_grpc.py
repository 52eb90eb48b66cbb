"""Couchbase gRPC status + details -> RetryReason or exception."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    AuthenticationFailureException,
    CasMismatchException,
    CollectionNotFoundException,
    CouchbaseException,
    DocumentExistsException,
    DocumentNotFoundException,
    FeatureNotAvailableException,
    InternalServerFailureException,
    InvalidArgumentException,
    RateLimitedException,
    RequestCanceledException,
    RetryableError,
    RetryReason,
    ScopeNotFoundException,
    UnambiguousTimeoutException,
)
from sdkcore.mapping import (
    BucketExistsException,
    BucketNotFoundException,
    CollectionExistsException,
    DocumentNotLockedException,
    GrpcCode,
    IndexExistsException,
    IndexNotFoundException,
    PathExistsException,
    PathMismatchException,
    PathNotFoundException,
    ScopeExistsException,
    ValueInvalidException,
    ValueTooLargeException,
    grpc_code,
    grpc_failure,
)

PRECONDITION = "type.googleapis.com/google.rpc.PreconditionFailure"
RESOURCE = "type.googleapis.com/google.rpc.ResourceInfo"
ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
DEBUG_INFO = "type.googleapis.com/google.rpc.DebugInfo"
ANY = "type.googleapis.com/google.protobuf.Any"

CODE_ROWS: list[tuple[GrpcCode, object]] = [
    (GrpcCode.UNAVAILABLE, RetryReason.SERVICE_NOT_AVAILABLE),
    (GrpcCode.CANCELLED, RequestCanceledException),
    (GrpcCode.NOT_FOUND, DocumentNotFoundException),
    (GrpcCode.ALREADY_EXISTS, DocumentExistsException),
    (GrpcCode.UNAUTHENTICATED, AuthenticationFailureException),
    (GrpcCode.PERMISSION_DENIED, AuthenticationFailureException),
    (GrpcCode.UNIMPLEMENTED, FeatureNotAvailableException),
    (GrpcCode.INVALID_ARGUMENT, InvalidArgumentException),
    (GrpcCode.OUT_OF_RANGE, InvalidArgumentException),
    (GrpcCode.ABORTED, InternalServerFailureException),
    (GrpcCode.UNKNOWN, InternalServerFailureException),
    (GrpcCode.INTERNAL, InternalServerFailureException),
    (GrpcCode.RESOURCE_EXHAUSTED, RateLimitedException),
    (GrpcCode.FAILED_PRECONDITION, CouchbaseException),
    (GrpcCode.DATA_LOSS, CouchbaseException),
]


def _reason(result: object) -> RetryReason | None:
    """The retry reason a mapped failure hands to the orchestrator (None: it completes)."""
    if isinstance(result, RetryableError):
        return result.reason
    assert isinstance(result, CouchbaseException), result
    return None


def _check(result: object, expected: object) -> None:
    if isinstance(expected, RetryReason):
        assert _reason(result) is expected
    else:
        assert type(result) is expected


@pytest.mark.parametrize(("code", "expected"), CODE_ROWS, ids=lambda v: getattr(v, "name", ""))
def test_code_rows(code: GrpcCode, expected: object) -> None:
    _check(grpc_failure(code, "server says no"), expected)


def test_deadline_exceeded_depends_on_read_only() -> None:
    assert type(grpc_failure("DEADLINE_EXCEEDED")) is AmbiguousTimeoutException
    assert type(grpc_failure("DEADLINE_EXCEEDED", read_only=True)) is UnambiguousTimeoutException
    # Nobody knows whether a read that timed out ran: it is unambiguous because running it
    # again changes nothing, never "it was not applied" (an operator's review)
    read = str(grpc_failure("DEADLINE_EXCEEDED", read_only=True))
    assert "it may have reached the server, but it is read-only" in read
    assert "not applied" not in read


def test_ok_is_not_a_failure() -> None:
    with pytest.raises(ValueError, match="OK is not a failure"):
        grpc_failure(0)


@pytest.mark.parametrize(
    "code",
    [
        14,
        GrpcCode.UNAVAILABLE,
        "UNAVAILABLE",
        "unavailable",
        " Unavailable ",
        "StatusCode.UNAVAILABLE",
    ],
)
def test_code_forms(code: object) -> None:
    assert grpc_code(code) is GrpcCode.UNAVAILABLE
    assert _reason(grpc_failure(code)) is RetryReason.SERVICE_NOT_AVAILABLE


def test_real_grpc_status_codes_match() -> None:
    grpc = pytest.importorskip("grpc")
    assert len(grpc.StatusCode) == 17
    for status in grpc.StatusCode:
        assert grpc_code(status).value == status.value[0], status
        assert grpc_code(status).name == status.name, status
        if status is not grpc.StatusCode.OK:
            by_enum, by_name = grpc_failure(status), grpc_failure(status.name)
            assert type(by_enum) is type(by_name)
            if isinstance(by_enum, RetryableError):
                assert _reason(by_enum) is _reason(by_name)


def test_duck_typed_status_code() -> None:
    class FakeCode:
        name = "NOT_FOUND"
        value = (5, "not found")

    assert type(grpc_failure(FakeCode())) is DocumentNotFoundException


@pytest.mark.parametrize(
    ("code", "error", "match"),
    [
        (17, ValueError, "0..16"),
        (-1, ValueError, "0..16"),
        ("NOPE", ValueError, "unknown gRPC status code name"),
        (True, TypeError, "grpc.StatusCode, int or name"),
        (1.0, TypeError, "grpc.StatusCode, int or name"),
    ],
)
def test_bad_codes(code: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        grpc_failure(code)


def test_module_imports_without_grpc() -> None:
    code = (
        "import sys; sys.modules['grpc'] = None\n"
        "from sdkcore import RetryReason\n"
        "from sdkcore.mapping import grpc_failure\n"
        "assert grpc_failure('UNAVAILABLE').reason is RetryReason.SERVICE_NOT_AVAILABLE\n"
        "assert 'grpc' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- ambiguity: the mapping path records what an sdkcore.grpc channel records ----------


def test_unavailable_is_maybe_applied_like_the_channel_records_it() -> None:
    failure = grpc_failure("UNAVAILABLE", "server restarting")
    assert isinstance(failure, RetryableError)
    assert failure.reason is RetryReason.SERVICE_NOT_AVAILABLE
    assert failure.effect is AttemptEffect.MAYBE_APPLIED
    assert "server restarting" in str(failure)


def test_locked_violation_is_not_applied_by_couchbase_protocol() -> None:
    failure = grpc_failure("FAILED_PRECONDITION", "", [precondition("LOCKED")])
    assert isinstance(failure, RetryableError)
    assert failure.effect is AttemptEffect.NOT_APPLIED


@pytest.mark.anyio
async def test_non_idempotent_write_answered_unavailable_is_sent_once() -> None:
    """UNAVAILABLE maps to SERVICE_NOT_AVAILABLE, whose RFC flag allows a non-idempotent
    retry, but the server answered: the attempt may have been applied, and the effect wins."""
    from sdkcore import Request, RequestCanceledException, RetryOrchestrator
    from sdkcore.mapping import raise_failure
    from sdkcore.testing import VirtualClock

    clock = VirtualClock()
    orchestrator = RetryOrchestrator(sleep=clock.sleep)
    request = Request(name="kv.upsert", timeout=0.5, clock=clock.clock)
    calls = 0

    async def send(request: Request) -> None:
        nonlocal calls
        calls += 1
        raise_failure(grpc_failure("UNAVAILABLE", "server restarting"))

    with pytest.raises(RequestCanceledException, match="may have been applied") as info:
        await orchestrator.execute(request, send)
    assert calls == 1
    context = info.value.context
    assert context is not None
    assert [a.effect for a in context.attempts] == [AttemptEffect.MAYBE_APPLIED]


# -- details -----------------------------------------------------------------------


def precondition(*types: str) -> dict[str, Any]:
    return {"@type": PRECONDITION, "violations": [{"type": t, "subject": "doc"} for t in types]}


def resource(rtype: str, name: str = "x", *, proto_names: bool = False) -> dict[str, Any]:
    if proto_names:
        return {"@type": RESOURCE, "resource_type": rtype, "resource_name": name}
    return {"@type": RESOURCE, "resourceType": rtype, "resourceName": name}


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (GrpcCode.FAILED_PRECONDITION, [precondition("LOCKED")], RetryReason.KV_LOCKED),
        (GrpcCode.FAILED_PRECONDITION, [precondition("NOT_LOCKED")], DocumentNotLockedException),
        (GrpcCode.FAILED_PRECONDITION, [precondition("PATH_MISMATCH")], PathMismatchException),
        (GrpcCode.FAILED_PRECONDITION, [precondition("VALUE_TOO_LARGE")], ValueTooLargeException),
        (GrpcCode.FAILED_PRECONDITION, [precondition("SOMETHING_NEW")], CouchbaseException),
        (GrpcCode.NOT_FOUND, [resource("document")], DocumentNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("collection")], CollectionNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("scope")], ScopeNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("bucket")], BucketNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("queryindex")], IndexNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("searchindex")], IndexNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("analyticsindex")], IndexNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("path")], PathNotFoundException),
        (GrpcCode.NOT_FOUND, [resource("widget")], DocumentNotFoundException),  # code fallback
        (GrpcCode.ALREADY_EXISTS, [resource("document")], DocumentExistsException),
        (GrpcCode.ALREADY_EXISTS, [resource("collection")], CollectionExistsException),
        (GrpcCode.ALREADY_EXISTS, [resource("scope")], ScopeExistsException),
        (GrpcCode.ALREADY_EXISTS, [resource("bucket")], BucketExistsException),
        (GrpcCode.ALREADY_EXISTS, [resource("queryindex")], IndexExistsException),
        (GrpcCode.ALREADY_EXISTS, [resource("path")], PathExistsException),
        (GrpcCode.ALREADY_EXISTS, [resource("scope", proto_names=True)], ScopeExistsException),
        # ResourceInfo only decides with NOT_FOUND / ALREADY_EXISTS.
        (GrpcCode.INTERNAL, [resource("collection")], InternalServerFailureException),
        (GrpcCode.ABORTED, [{"@type": ERROR_INFO, "reason": "CAS_MISMATCH"}], CasMismatchException),
        (
            GrpcCode.ABORTED,
            [{"@type": ERROR_INFO, "reason": "OTHER"}],
            InternalServerFailureException,
        ),
        # Undecisive details are skipped; the first decisive one wins.
        (
            GrpcCode.FAILED_PRECONDITION,
            [{"@type": DEBUG_INFO, "detail": "x"}, precondition("LOCKED")],
            RetryReason.KV_LOCKED,
        ),
        (
            GrpcCode.NOT_FOUND,
            [resource("collection"), resource("scope")],
            CollectionNotFoundException,
        ),
        # Details decide before the code: LOCKED under UNAVAILABLE is still KV_LOCKED.
        (GrpcCode.UNAVAILABLE, [precondition("LOCKED")], RetryReason.KV_LOCKED),
        # LOCKED anywhere in any PreconditionFailure wins over every other detail.
        (
            GrpcCode.FAILED_PRECONDITION,
            [precondition("NOT_LOCKED", "LOCKED")],
            RetryReason.KV_LOCKED,
        ),
        (
            GrpcCode.FAILED_PRECONDITION,
            [precondition("NOT_LOCKED"), precondition("PATH_MISMATCH", "LOCKED")],
            RetryReason.KV_LOCKED,
        ),
        (
            GrpcCode.ABORTED,
            [{"@type": ERROR_INFO, "reason": "CAS_MISMATCH"}, precondition("LOCKED")],
            RetryReason.KV_LOCKED,
        ),
        # Otherwise the first known violation of a PreconditionFailure decides.
        (
            GrpcCode.FAILED_PRECONDITION,
            [precondition("SOMETHING_NEW", "PATH_MISMATCH", "NOT_LOCKED")],
            PathMismatchException,
        ),
    ],
)
def test_detail_rows(code: GrpcCode, details: list[Any], expected: object) -> None:
    _check(grpc_failure(code, "msg", details), expected)


@pytest.mark.parametrize("code", [GrpcCode.INVALID_ARGUMENT, GrpcCode.OUT_OF_RANGE])
@pytest.mark.parametrize(
    ("violation", "cls"),
    [("VALUE_TOO_LARGE", ValueTooLargeException), ("VALUE_OUT_OF_RANGE", ValueInvalidException)],
)
def test_detail_exceptions_stay_invalid_argument_under_invalid_argument_codes(
    code: GrpcCode, violation: str, cls: type[CouchbaseException]
) -> None:
    # The code alone maps to InvalidArgumentException; the detail only refines it.
    result = grpc_failure(code, "too big", [precondition(violation)])
    assert type(result) is cls
    assert isinstance(result, InvalidArgumentException)
    assert isinstance(result, CouchbaseException)


def test_exception_message_carries_status_message_and_resource() -> None:
    exc = grpc_failure("NOT_FOUND", "collection gone", [resource("collection", "inventory.hotels")])
    assert isinstance(exc, CollectionNotFoundException)
    assert "inventory.hotels" in str(exc)
    assert "NOT_FOUND" in str(exc)
    assert "collection gone" in str(exc)


def test_decoded_message_objects() -> None:
    class Violation:
        def __init__(self, type: str) -> None:
            self.type = type

    class PreconditionFailure:
        def __init__(self, *types: str) -> None:
            self.violations = [Violation(t) for t in types]

    class Descriptor:
        full_name = "google.rpc.ResourceInfo"

    class SomeGeneratedClass:
        DESCRIPTOR = Descriptor()
        resource_type = "bucket"
        resource_name = "travel"
        owner = ""

    class ErrorInfo:
        reason = "CAS_MISMATCH"

    assert _reason(grpc_failure(9, "", [PreconditionFailure("LOCKED")])) is RetryReason.KV_LOCKED
    assert type(grpc_failure(5, "", [SomeGeneratedClass()])) is BucketNotFoundException
    assert type(grpc_failure(10, "", [ErrorInfo()])) is CasMismatchException
    assert type(grpc_failure(10, "", [object()])) is InternalServerFailureException


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"details": [{"violations": []}]},
            ValueError,
            r'details\[0\] is a mapping without an "@type"',
        ),
        ({"details": {"@type": PRECONDITION}}, TypeError, "must be an iterable of status details"),
        ({"details": "LOCKED"}, TypeError, "must be an iterable of status details"),
        ({"message": 3}, TypeError, r"grpc_failure\(message\) must be a str"),
        ({"read_only": "yes"}, TypeError, r"grpc_failure\(read_only\) must be a bool"),
    ],
)
def test_bad_details(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        grpc_failure("FAILED_PRECONDITION", **kwargs)


def test_violations_from_an_iterator_are_read_once() -> None:
    class Violation:
        def __init__(self, type: str) -> None:
            self.type = type

    class PreconditionFailure:
        def __init__(self, *types: str) -> None:
            self.violations = iter([Violation(t) for t in types])

    result = grpc_failure(9, "", [PreconditionFailure("NOT_LOCKED", "PATH_MISMATCH")])
    assert type(result) is DocumentNotLockedException


def test_malformed_violations_do_not_crash() -> None:
    detail = {"@type": PRECONDITION, "violations": 3}
    assert type(grpc_failure(9, "", [detail])) is CouchbaseException


# -- properties --------------------------------------------------------------------

violation_types = st.sampled_from(["LOCKED", "NOT_LOCKED", "DOC_NOT_JSON", "ZZZ"])
detail_strategy = st.one_of(
    st.lists(violation_types, min_size=1, max_size=3).map(lambda ts: precondition(*ts)),
    st.builds(
        resource,
        st.sampled_from(["document", "scope", "collection", "bucket", "path", "queryindex", "x"]),
    ),
    st.builds(lambda r: {"@type": ERROR_INFO, "reason": r}, st.sampled_from(["CAS_MISMATCH", "Q"])),
    st.just({"@type": DEBUG_INFO}),
)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 16), st.text(max_size=20), st.lists(detail_strategy, max_size=3), st.booleans()
)
def test_every_result_is_a_reason_or_a_couchbase_exception(
    code: int, message: str, details: list[Any], read_only: bool
) -> None:
    result = grpc_failure(code, message, details, read_only=read_only)
    assert isinstance(result, (RetryableError, CouchbaseException))
    locked = any(
        d.get("@type") == PRECONDITION and any(v["type"] == "LOCKED" for v in d["violations"])
        for d in details
    )
    # A LOCKED violation anywhere is KV_LOCKED; otherwise only UNAVAILABLE is retried.
    # Every retry carries the effect of an answer from the server, never NOT_SENT.
    if locked:
        assert isinstance(result, RetryableError)
        assert result.reason is RetryReason.KV_LOCKED
        assert result.effect is AttemptEffect.NOT_APPLIED
    elif isinstance(result, RetryableError):
        assert result.reason is RetryReason.SERVICE_NOT_AVAILABLE
        assert result.effect is AttemptEffect.MAYBE_APPLIED
        assert code == GrpcCode.UNAVAILABLE


# -- packed google.protobuf.Any ----------------------------------------------------


class FakeAny:
    """Shaped like ``google.protobuf.any_pb2.Any``: ``type_url`` and packed ``value`` bytes."""

    def __init__(self, type_url: str, value: bytes = b"") -> None:
        self.type_url = type_url
        self.value = value


class DescribedAny:
    """A message object whose descriptor says google.protobuf.Any."""

    class DESCRIPTOR:
        full_name = "google.protobuf.Any"


@pytest.fixture
def no_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``google.rpc.error_details_pb2`` unimportable, whether or not it is installed."""
    monkeypatch.setitem(sys.modules, "google.rpc.error_details_pb2", None)


PACKED_ANY_DETAILS: list[Any] = [
    {"@type": ANY, "type_url": PRECONDITION, "value": b"\x0a\x08\x0a\x06LOCKED"},
    FakeAny(PRECONDITION, b"\x0a\x08\x0a\x06LOCKED"),
    DescribedAny(),
]


@pytest.mark.usefixtures("no_protobuf")
@pytest.mark.parametrize(
    "detail", PACKED_ANY_DETAILS, ids=["mapping", "type_url+value", "descriptor"]
)
def test_packed_any_is_refused_when_it_cannot_be_unpacked(detail: Any) -> None:
    # Silently skipping it would hide a LOCKED violation: KV_LOCKED would not be retried.
    with pytest.raises(TypeError, match=r"details\[1\] is a packed google\.protobuf\.Any") as info:
        grpc_failure("FAILED_PRECONDITION", "locked", [{"@type": DEBUG_INFO}, detail])
    assert "unpack" in str(info.value)


def test_packed_any_of_an_unknown_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"details\[0\] is a packed google\.protobuf\.Any"):
        grpc_failure("FAILED_PRECONDITION", "", [FakeAny("type.googleapis.com/acme.Thing")])


def test_json_form_of_an_any_holding_a_detail_is_unpacked() -> None:
    # proto3 JSON of an Any whose payload is itself an Any: the payload sits under "value".
    nested = {"@type": ANY, "value": precondition("LOCKED")}
    assert _reason(grpc_failure("FAILED_PRECONDITION", "", [nested])) is RetryReason.KV_LOCKED
    twice = {"@type": ANY, "value": {"@type": ANY, "value": resource("scope")}}
    assert type(grpc_failure("NOT_FOUND", "", [twice])) is ScopeNotFoundException


def _fake_error_details_module() -> types.ModuleType:
    """A stand-in for google.rpc.error_details_pb2 whose messages parse a toy encoding."""

    class Violation:
        def __init__(self, type: str) -> None:
            self.type = type

    class PreconditionFailure:
        class DESCRIPTOR:
            full_name = "google.rpc.PreconditionFailure"

        def __init__(self) -> None:
            self.violations: list[Violation] = []

        def ParseFromString(self, data: bytes) -> int:
            if not data.startswith(b"V:"):
                raise ValueError("bad wire data")
            self.violations = [Violation(t) for t in data[2:].decode().split(",")]
            return len(data)

    module = types.ModuleType("google.rpc.error_details_pb2")
    module.PreconditionFailure = PreconditionFailure  # type: ignore[attr-defined]
    return module


def test_packed_any_is_unpacked_when_error_details_are_importable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "google.rpc.error_details_pb2", _fake_error_details_module())
    packed = FakeAny(PRECONDITION, b"V:NOT_LOCKED,LOCKED")
    assert _reason(grpc_failure("FAILED_PRECONDITION", "", [packed])) is RetryReason.KV_LOCKED
    as_mapping = {"@type": ANY, "type_url": PRECONDITION, "value": b"V:PATH_MISMATCH"}
    assert type(grpc_failure(9, "", [as_mapping])) is PathMismatchException
    # A type the module does not define is still refused, not skipped.
    with pytest.raises(TypeError, match=r"details\[0\] is a packed google\.protobuf\.Any"):
        grpc_failure(9, "", [FakeAny(RESOURCE, b"")])


def test_real_protobuf_any_is_unpacked() -> None:
    error_details_pb2 = pytest.importorskip("google.rpc.error_details_pb2")
    any_pb2 = pytest.importorskip("google.protobuf.any_pb2")
    failure = error_details_pb2.PreconditionFailure()
    failure.violations.add(type="NOT_LOCKED", subject="doc")
    failure.violations.add(type="LOCKED", subject="doc")
    packed = any_pb2.Any()
    packed.Pack(failure)
    assert _reason(grpc_failure("FAILED_PRECONDITION", "", [packed])) is RetryReason.KV_LOCKED
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ResourceInfo(resource_type="collection", resource_name="c"))
    assert type(grpc_failure("NOT_FOUND", "", [info])) is CollectionNotFoundException
    broken = any_pb2.Any(type_url=PRECONDITION, value=b"\xff\xff\xff")
    with pytest.raises(ValueError, match=r"details\[0\].*could not be decoded"):
        grpc_failure("FAILED_PRECONDITION", "", [broken])
