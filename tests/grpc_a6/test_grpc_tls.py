"""``sdkcore.grpc.secure_channel`` against a real grpc.aio server on 127.0.0.1 over TLS.

A self-signed certificate for 127.0.0.1 is made for the module by the ``openssl`` command
(.ci/run installs it when missing; without it these tests skip, and fail under CI=true).
The channel's A6 retries and hedges run over TLS as over a plain channel, and TLS is
really used: a client that does not trust the certificate never reaches the server (its
calls are retried transparently until their deadline, A6's "never left the client", and
the error says why), and a plain-text client cannot talk to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402

import sdkcore.grpc  # noqa: E402

pytestmark = pytest.mark.asyncio

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """(private key, certificate) in PEM, the certificate self-signed for 127.0.0.1."""
    openssl = shutil.which("openssl")
    if openssl is None:
        if os.environ.get("CI") == "true":
            pytest.fail("openssl is not installed (.ci/run installs it): TLS tests cannot run")
        pytest.skip("openssl is not installed: the TLS tests need it to make a certificate")
    folder: Path = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return key.read_bytes(), cert.read_bytes()


async def _tls_server(pem: tuple[bytes, bytes]) -> Server:
    server = Server()
    server.unary_unary("Echo", _fails_twice)
    await server.start(credentials=grpc.ssl_server_credentials([pem]))
    return server


async def _fails_twice(request: bytes, context: Any, n: int) -> bytes:
    if n <= 2:
        await abort(context, UNAVAILABLE)
    return b"tls:" + request


async def test_a_retry_policy_runs_over_tls(pem: tuple[bytes, bytes]) -> None:
    server = await _tls_server(pem)
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with sdkcore.grpc.secure_channel(
                server.target,
                grpc.ssl_channel_credentials(root_certificates=pem[1]),
                service_config=retry_config(max_attempts=3),
            ) as channel:
                answer = await channel.unary_unary("/test.Svc/Echo")(b"x", timeout=5)
        assert answer == b"tls:x"
        assert server.count("Echo") == 3  # two UNAVAILABLE, retried by sdkcore over TLS
        assert [a.get("grpc-previous-rpc-attempts") for a in server.attempts["Echo"]] == [
            None,
            "1",
            "2",
        ]
    finally:
        await server.stop()


async def test_a_hedging_policy_runs_over_tls(pem: tuple[bytes, bytes]) -> None:
    server = await _tls_server(pem)
    config = (
        '{"methodConfig": [{"name": [{"service": "test.Svc"}], "hedgingPolicy": '
        '{"maxAttempts": 3, "hedgingDelay": "0s", "nonFatalStatusCodes": ["UNAVAILABLE"]}}]}'
    )
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with sdkcore.grpc.secure_channel(
                server.target,
                grpc.ssl_channel_credentials(root_certificates=pem[1]),
                service_config=config,
            ) as channel:
                answer = await channel.unary_unary("/test.Svc/Echo")(b"h", timeout=5)
        assert answer == b"tls:h"
        assert server.count("Echo") == 3  # three copies at once: two fail, the third answers
    finally:
        await server.stop()


async def test_a_client_that_does_not_trust_the_certificate_never_reaches_the_server(
    pem: tuple[bytes, bytes],
) -> None:
    server = await _tls_server(pem)
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with sdkcore.grpc.secure_channel(
                server.target,
                grpc.ssl_channel_credentials(),  # the system's roots: not our self-signed one
                service_config=retry_config(max_attempts=3),
            ) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await channel.unary_unary("/test.Svc/Echo")(b"x", timeout=5)
        # Never left the client: each attempt fails fast with UNAVAILABLE, as grpcio's, and
        # the policy's attempts are used (rfc/0003, "Fail fast"); the error says why the
        # channel could not connect.
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "CERTIFICATE_VERIFY_FAILED" in failed.value.debug_error_string()
        assert failed.value.debug_error_string().startswith("sdkcore: 3 attempts; ")
        assert server.count("Echo") == 0
    finally:
        await server.stop()


async def test_a_plain_text_client_cannot_talk_to_the_tls_server(
    pem: tuple[bytes, bytes],
) -> None:
    server = await _tls_server(pem)
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with sdkcore.grpc.insecure_channel(server.target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await channel.unary_unary("/test.Svc/Echo")(b"x", timeout=5)
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE  # at once, as grpcio's
        assert server.count("Echo") == 0
    finally:
        await server.stop()


async def test_a_secure_channel_records_telemetry(pem: tuple[bytes, bytes]) -> None:
    """``secure_channel(..., telemetry=...)`` records as ``insecure_channel`` does (only
    the insecure one was tested): A66/A96 per call and sdkcore's core metrics."""
    pytest.importorskip("opentelemetry.sdk")
    from telemetry_kit import Otel

    otel = Otel()
    server = await _tls_server(pem)
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with sdkcore.grpc.secure_channel(
                server.target,
                grpc.ssl_channel_credentials(root_certificates=pem[1]),
                service_config=retry_config(max_attempts=3),
                telemetry=otel.telemetry,
            ) as channel:
                assert await channel.unary_unary("/test.Svc/Echo")(b"x", timeout=5) == b"tls:x"
        metrics = otel.metrics()
        started = metrics["grpc.client.attempt.started"].points
        assert sum(value for _, value in started) == 3
        assert {a["grpc.target"] for a, _ in started} == {f"dns:///{server.target}"}
        (retries,) = metrics["grpc.client.call.retries"].points
        assert retries[1] == (1, 2)  # one call, retried twice
        assert metrics["sdkcore.retries"].total() == 2
    finally:
        await server.stop()
        otel.shutdown()
