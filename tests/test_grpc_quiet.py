"""grpc core's INFO lines never reach stderr from sdkcore's in-process test servers.

grpcio (absl logging) prints INFO lines such as ``I1125 ... chttp2_transport.cc ...
Got goaway`` when a test server stops under a connected channel, unless
GRPC_VERBOSITY says otherwise, and it reads the variable once, when grpc is imported.
The sdkcore pytest plugin and ``sdkcore.testing`` set its documented default (ERROR)
first; a value the user set is kept. Each case runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc")

ROOT = Path(__file__).resolve().parent.parent
GRPC_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)

# Several servers stopped under connected channels: enough GOAWAYs that an unset
# GRPC_VERBOSITY prints INFO lines.
SERVERS = """
import sdkcore.grpc  # imports grpc before the test helper
from sdkcore.mapping import GrpcCode
from sdkcore.testing import grpc_server


async def serve_and_stop(times=6):
    for _ in range(times):
        async with grpc_server([GrpcCode.UNAVAILABLE, b"value"]) as server:
            async with sdkcore.grpc.insecure_channel(server.target) as channel:
                try:
                    await channel.unary_unary("/demo.Kv/Get")(b"key", timeout=5)
                except Exception:
                    pass
"""

TEST_FILE = (
    SERVERS
    + """
import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_servers():
    await serve_and_stop()
"""
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env.update(extra)
    return env


def test_a_pytest_session_using_grpc_server_prints_no_grpc_log_lines(tmp_path: Path) -> None:
    (tmp_path / "test_servers.py").write_text(TEST_FILE, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s", "test_servers.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert GRPC_LOG_LINE.search(done.stderr) is None, done.stderr
    assert GRPC_LOG_LINE.search(done.stdout) is None, done.stdout


def test_a_script_importing_sdkcore_testing_first_prints_nothing(tmp_path: Path) -> None:
    script = (
        "from sdkcore import testing\n"
        + SERVERS
        + "\nimport asyncio\nasyncio.run(serve_and_stop())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize("preset", [None, "DEBUG"])
def test_the_default_is_error_and_a_users_setting_is_kept(preset: str | None) -> None:
    env = _env() if preset is None else _env(GRPC_VERBOSITY=preset)
    done = subprocess.run(
        [sys.executable, "-c", "import os, sdkcore.testing; print(os.environ['GRPC_VERBOSITY'])"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    assert done.stdout.strip() == (preset or "ERROR")
