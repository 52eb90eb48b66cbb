"""Where sdkcore's events go by default (README "Logging").

Each case runs in a fresh interpreter: structlog's configuration is process-global, and
"unconfigured" can only be tested where nothing configured it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

RETRY_THREE_TIMES = """
import anyio
from sdkcore import RetryOrchestrator, Request, RetryReason, RetryableError
from sdkcore.testing import ScriptedSend

async def main():
    send = ScriptedSend([RetryReason.KV_LOCKED] * 3 + ["value"])
    await RetryOrchestrator().execute(Request(name="kv.get", idempotent=True), send)
    try:
        await RetryOrchestrator().execute(
            Request(name="kv.upsert"), ScriptedSend([RetryReason.UNKNOWN])
        )
    except Exception:
        pass

anyio.run(main)
"""


def run(prelude: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(prelude) + RETRY_THREE_TIMES
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )


def test_stdlib_only_app_sees_nothing_on_stdout_by_default() -> None:
    done = run("import logging\nlogging.basicConfig()\n")  # WARNING: the stdlib default
    assert done.stdout == ""
    assert "retry." not in done.stderr


def test_stdlib_app_that_enables_sdkcore_gets_the_events_in_its_handlers() -> None:
    done = run(
        """
        import logging, sys
        logging.basicConfig(stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
        logging.getLogger("sdkcore").setLevel(logging.DEBUG)
        """
    )
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    scheduled = [line for line in lines if "retry.scheduled" in line]
    assert len(scheduled) == 3
    assert scheduled[0].startswith("sdkcore DEBUG retry.scheduled request_id=")
    assert "reason='KV_LOCKED'" in scheduled[0]
    refused = [line for line in lines if "retry.not_retried" in line]
    assert len(refused) == 1
    assert refused[0].startswith("sdkcore INFO ")
    assert "why='not_idempotent'" in refused[0]


def test_info_level_shows_refusals_but_not_each_retry() -> None:
    done = run(
        """
        import logging, sys
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        """
    )
    assert "retry.scheduled" not in done.stderr
    assert "retry.not_retried" in done.stderr


def test_structlog_app_gets_the_events_through_its_own_pipeline() -> None:
    done = run(
        """
        import structlog
        seen = []
        def keep(logger, method, event_dict):
            seen.append(event_dict["event"])
            raise structlog.DropEvent
        structlog.configure(processors=[keep])
        import atexit, sys
        atexit.register(lambda: sys.stdout.write(",".join(seen)))
        """
    )
    assert done.stdout == ",".join(["retry.scheduled"] * 3 + ["retry.not_retried"])


def test_structlog_filtering_level_is_honoured() -> None:
    done = run(
        """
        import logging, structlog
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
        """
    )
    assert "retry.scheduled" not in done.stdout
    assert "retry.not_retried" in done.stdout  # structlog's own renderer prints to stdout


def test_library_code_never_configures_structlog() -> None:
    done = run(
        """
        import structlog
        def refuse(*a, **k):
            raise AssertionError("sdkcore called structlog.configure")
        structlog.configure = refuse
        structlog.configure_once = refuse
        """
    )
    assert done.returncode == 0


def test_no_structlog_private_modules_in_the_library() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "sdkcore"
    private = re.compile(r"structlog\._|from structlog import _")
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if private.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_an_app_without_structlog_never_loads_it_through_sdkcore() -> None:
    """A warning (a strategy that raised) goes to the stdlib logger, structlog never loaded.

    Loading structlog lazily would put tens of milliseconds inside the request whose
    event it is.
    """
    code = textwrap.dedent(
        """
        import asyncio, logging, sys
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record)
        logging.getLogger("sdkcore").addHandler(Keep())
        from sdkcore import RetryOrchestrator, Request, RetryReason
        from sdkcore.testing import ScriptedSend

        class Broken:
            def retry_after(self, request, reason):
                raise RuntimeError("strategy bug")

        async def main():
            try:
                await RetryOrchestrator(Broken()).execute(
                    Request(idempotent=True), ScriptedSend([RetryReason.KV_LOCKED])
                )
            except RuntimeError:
                pass

        asyncio.run(main())
        assert "structlog" not in sys.modules, "structlog was imported"
        [record] = records
        assert record.levelno == logging.WARNING, record.levelno
        assert record.getMessage().startswith("retry.strategy_failed request_id="), record.msg
        assert record.sdkcore["reason"] == "KV_LOCKED", record.sdkcore
        assert record.sdkcore["event"] == "retry.strategy_failed", record.sdkcore
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
