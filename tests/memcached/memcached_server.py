"""Real memcached processes for the tests: 127.0.0.1, a free port, killed in teardown."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

INSTALL = "apt-get install memcached"
#: A safety net on every wait for a process, not a timing claim.
START_TIMEOUT = 10.0


def memcached_binary() -> str:
    """The memcached path; skip locally, fail under CI=true, when it is not installed."""
    path = shutil.which("memcached")
    if path is None:
        message = f"memcached is not installed; install it with: {INSTALL}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} (CI=true: the memcached integration tests must run)")
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Memcached:
    """One memcached on 127.0.0.1:``port`` (binary protocol). Restartable on the same port."""

    def __init__(self, binary: str, *args: str) -> None:
        self.binary = binary
        self.args = args
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Memcached:
        command = [
            self.binary,
            "-l", "127.0.0.1",
            "-p", str(self.port),
            "-U", "0",  # no UDP
            "-B", "binary",
            "-t", "1",
            *self.args,
        ]  # fmt: skip
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command += ["-u", "root"]  # memcached refuses to run as root without -u
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"memcached exited at start ({self.process.returncode}): {err}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"memcached did not listen on {self.port}") from None
                time.sleep(0.02)

    def kill(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
        if process is not None:
            process.wait(timeout=START_TIMEOUT)
            if process.stderr is not None:
                process.stderr.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"
