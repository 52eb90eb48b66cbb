"""OpenTelemetry export of retry statistics (optional: ``sdkcore[otel]``)."""

from __future__ import annotations

from typing import Any

from .._install import install_hint

__all__ = ["OtelRecorder"]


class OtelRecorder:
    __slots__ = ("_attempts", "_failed", "_transparent")

    def __init__(self, meter: Any = None) -> None:
        try:
            import opentelemetry.metrics as metrics
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "OpenTelemetry export needs the opentelemetry-api package: "
                + install_hint("opentelemetry")
            ) from exc
        if meter is None:
            meter = metrics.get_meter("sdkcore.grpc")
        self._attempts = meter.create_counter(
            "grpc.client.retry.attempts",
            unit="{attempt}",
            description="Retry attempts started (A6), by method and histogram bucket",
        )
        self._failed = meter.create_counter(
            "grpc.client.retry.failed_attempts",
            unit="{attempt}",
            description="Retry attempts that ended with a non-OK status",
        )
        self._transparent = meter.create_counter(
            "grpc.client.retry.transparent",
            unit="{attempt}",
            description="Transparent retries (request never left the client)",
        )

    def record_retry(self, method: str, bucket: int) -> None:
        self._attempts.add(1, {"grpc.method": method, "grpc.retry.bucket": f">={bucket}"})

    def record_failed_retry(self, method: str) -> None:
        self._failed.add(1, {"grpc.method": method})

    def record_transparent_retry(self, method: str) -> None:
        self._transparent.add(1, {"grpc.method": method})
