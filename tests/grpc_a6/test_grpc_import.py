"""``import sdkcore`` and the pure parts of ``sdkcore.grpc`` never import grpcio."""

from __future__ import annotations

import subprocess
import sys


def test_core_and_config_do_not_import_grpc() -> None:
    code = (
        "import sys, sdkcore, sdkcore.grpc\n"
        "from sdkcore.grpc import ServiceConfig, RetryThrottler, A6RetryStrategy, RetryStats\n"
        "ServiceConfig.from_json('{}')\n"
        "assert 'grpc' not in sys.modules, sorted(m for m in sys.modules if 'grpc' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
