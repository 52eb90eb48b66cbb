"""How to install an optional dependency, in words that work today (sdkcore is not on PyPI).

Every hint for a missing optional import (the CLI, the demo, ``sdkcore.grpc``,
``sdkcore.testing``, the OpenTelemetry export) comes from :func:`install_hint`.
"""

from __future__ import annotations

__all__ = ["install_hint"]

#: The PyPI package each optional import comes from, and the sdkcore extra that brings it.
_PACKAGES = {
    "rich": ("rich", "cli"),
    "grpc": ("grpcio", "grpc"),
    "opentelemetry": ("opentelemetry-api", "otel"),
}


def install_hint(module: str) -> str:
    """How to install what ``module`` (``rich``, ``grpc``, ``opentelemetry``) needs.

    Installing the extra by sdkcore's name fails while sdkcore is not published, so
    the hint names the dependency itself (on PyPI), then the extra from a checkout.
    """
    package, extra = _PACKAGES[module]
    return (
        f"pip install {package} (or sdkcore's '{extra}' extra from a checkout: "
        f"pip install -e '/path/to/sdkcore[{extra}]'; sdkcore is not on PyPI)"
    )
