"""A real Prometheus server for the tests: 127.0.0.1, a free port, a temp config and storage.

Its scrape targets are fixed when it starts (``static_configs``): once
:meth:`Prometheus.wait_scraping` returns, a target that comes up is scraped from its
first second. Queries go through the HTTP API
(``/api/v1/query``). Without the ``prometheus`` binary the tests skip locally and
fail under ``CI=true`` (``.ci/run`` installs it), as the memcached tests do.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

INSTALL = "apt-get install prometheus"
#: A safety net on every wait (a start, a query), not a timing claim.
START_TIMEOUT = 20.0
JOB = "sdkcore-demo"


def prometheus_binary() -> str:
    """The prometheus path; skip locally, fail under CI=true, when it is not installed."""
    path = shutil.which("prometheus")
    if path is None:
        message = f"prometheus is not installed; install it with: {INSTALL}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} (CI=true: the Prometheus integration test must run)")
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Prometheus:
    """One Prometheus on 127.0.0.1, scraping job :data:`JOB` every ``interval``."""

    def __init__(
        self, binary: str, workdir: Path, targets: list[str], interval: str = "1s"
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.targets = targets
        self.interval = interval
        self.port = free_port()
        self.log_file = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        config = self.workdir / "prometheus.yml"
        # JSON is YAML: no YAML library needed.
        config.write_text(
            json.dumps(
                {
                    "global": {
                        "scrape_interval": self.interval,
                        "scrape_timeout": self.interval,
                        "evaluation_interval": self.interval,
                    },
                    "scrape_configs": [
                        {
                            "job_name": JOB,
                            "static_configs": [{"targets": self.targets}],
                        }
                    ],
                }
            ),
            encoding="utf-8",
        )
        storage = self.workdir / "data"
        storage.mkdir()
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={storage}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        return self

    def wait_scraping(self) -> None:
        """Wait until every target is being scraped (``up`` exists for each, 0 while down).

        Prometheus answers ``/-/ready`` seconds before it scrapes: its discovery hands the
        scrape loops their targets on a 5 s tick, static targets included.
        """
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited at start: {self.log()}")
            try:
                if len(self.query(f'up{{job="{JOB}"}}')) == len(self.targets):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass  # not listening yet, or starting (503, not JSON)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"prometheus did not scrape its targets in {START_TIMEOUT} s: {self.log()}"
                )
            time.sleep(0.05)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (``result`` of /api/v1/query)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=5.0) as answer:
                body = json.load(answer)
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the error in JSON
            body = json.load(exc)
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def value(self, expr: str) -> float:
        """The one value of ``expr`` (0 for an empty vector: a counter never incremented)."""
        result = self.query(expr)
        if not result:
            return 0.0
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def by(self, label: str, expr: str) -> dict[str, float]:
        """``expr``'s values keyed by ``label`` (e.g. ``sum by (instance) (...)``)."""
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(expr)}

    def log(self) -> str:
        try:
            return self.log_file.read_text(encoding="utf-8", errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5.0)
