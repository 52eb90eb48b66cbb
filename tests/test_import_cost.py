"""``import sdkcore`` loads the request path only (issue 24, bench/README "against import attrs").

The classes a request needs only when the application built one are imported at their
first use through ``sdkcore.__getattr__`` (PEP 562), and ``logging`` is not imported by
sdkcore at all: the ``sdkcore`` stdlib logger and its NullHandler are attached once the
application (or asyncio, trio) imported ``logging``. Each case runs in a fresh
interpreter: what a process has imported is process-global.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sdkcore

#: The public classes loaded at their first use, and the private modules they live in.
LAZY_CLASSES = {
    "AdaptiveConcurrencyLimiter": "_adaptive_limiter",
    "AdaptiveThrottle": "_throttle",
    "CircuitBreaker": "_breaker",
    "CircuitState": "_breaker",
    "ConcurrencyLimiter": "_limiter",
    "HedgePolicy": "_hedge_policy",
    "HedgeThrottler": "_hedge_policy",
    "LatencyQuantile": "_latency",
    "OrphanReporter": "_orphans",
    "RetryBudget": "_budget",
    "Telemetry": "_telemetry",
    "ThresholdReporter": "_threshold",
    "default_is_rejection": "_throttle",  # the throttle's default, to extend (rfc/0009)
}
#: What ``import sdkcore`` and a request without them must not load: their modules and
#: the private modules only they import.
NOT_LOADED = sorted(
    {f"sdkcore.{m}" for m in LAZY_CLASSES.values()} | {"sdkcore._permits", "sdkcore._sample"}
)


def run(*code: str) -> str:
    """The output of a fresh interpreter running ``code`` (pieces, each dedented)."""
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(textwrap.dedent(piece) for piece in code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


# -- the lazy public classes -----------------------------------------------------------------


def test_import_sdkcore_loads_no_lazy_module_and_not_logging() -> None:
    out = run(
        """
        import sys
        import sdkcore
        print(sorted(m for m in sys.modules if m.startswith("sdkcore.")))
        print("logging" in sys.modules)
        """
    )
    loaded, logging_loaded = out.splitlines()
    for module in NOT_LOADED:
        assert repr(module) not in loaded
    assert "'sdkcore._orchestrator'" in loaded  # the request path is there
    assert logging_loaded == "False"


def test_the_lazy_table_is_the_one_tested_here() -> None:
    assert sdkcore._LAZY == LAZY_CLASSES


SYNC_REQUESTS = """
    import sys
    import sdkcore

    calls = []

    def send(request):
        calls.append(1)
        if len(calls) % 3:
            raise sdkcore.RetryableError(sdkcore.RetryReason.KV_LOCKED)
        return "ok"

    orchestrator = sdkcore.RetryOrchestrator(sdkcore.BestEffortRetryStrategy())
    request = sdkcore.Request(name="kv.get", idempotent=True, timeout=5)
    assert orchestrator.execute_sync(request, send, sleep=lambda s: None) == "ok"

    class Broken:  # retry.strategy_failed: a warning, the one lastResort would print
        def retry_after(self, request, reason):
            raise RuntimeError("strategy lookup failed")

    try:
        sdkcore.RetryOrchestrator(default_strategy=Broken()).execute_sync(
            sdkcore.Request(name="kv.get", idempotent=True, timeout=5), send
        )
    except RuntimeError:
        pass
    else:
        raise AssertionError("the strategy's error was not raised")
    """


def test_requests_without_the_lazy_classes_load_none_of_them() -> None:
    out = run(
        SYNC_REQUESTS,
        """
    print(sorted(m for m in sys.modules if m.startswith("sdkcore.")))
    print("logging" in sys.modules)
    """,
    )
    loaded, logging_loaded = out.splitlines()
    for module in NOT_LOADED:
        assert repr(module) not in loaded
    assert logging_loaded == "False"  # and an event at warning level printed nothing


@pytest.mark.parametrize(
    ("loop", "run_main"), [("asyncio", "asyncio.run(main())"), ("trio", "trio.run(main)")]
)
def test_an_async_request_loads_none_of_them(loop: str, run_main: str) -> None:
    out = run(
        f"""
        import sys
        import {loop}
        import sdkcore
        from sdkcore.testing import instant_retries

        async def main():
            calls = []

            async def send(request):
                calls.append(1)
                if len(calls) < 3:
                    raise sdkcore.RetryableError(sdkcore.RetryReason.KV_LOCKED)
                return "ok"

            request = sdkcore.Request(name="kv.get", idempotent=True, timeout=5)
            with instant_retries():  # sdkcore.testing: no lazy module either
                assert await sdkcore.RetryOrchestrator().execute(request, send) == "ok"

        {run_main}
        print(sorted(m for m in sys.modules if m.startswith("sdkcore.")))
        """
    )
    for module in NOT_LOADED:
        assert repr(module) not in out


def test_every_public_name_resolves_and_star_import_gives_them_all() -> None:
    out = run(
        """
        import sdkcore
        names = {}
        exec("from sdkcore import *", names)
        missing = [n for n in sdkcore.__all__ if n not in names]
        assert missing == [], missing
        for name in sdkcore.__all__:
            assert getattr(sdkcore, name) is names[name], name
            assert name in dir(sdkcore), name
        print("ok")
        """
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("name", sorted(LAZY_CLASSES))
def test_a_lazy_class_is_loaded_on_first_use_and_named_sdkcore(name: str) -> None:
    module = f"sdkcore.{LAZY_CLASSES[name]}"
    out = run(
        f"""
        import sys
        import sdkcore
        assert {name!r} in dir(sdkcore) and {name!r} in sdkcore.__all__
        assert {module!r} not in sys.modules
        cls = sdkcore.{name}
        assert {module!r} in sys.modules
        assert cls is getattr(sys.modules[{module!r}], {name!r})
        from sdkcore import {name} as again
        assert again is cls
        # classes show as sdkcore.X; a function keeps its module, as dispatch_unsent does
        print(cls.__module__ if isinstance(cls, type) else "sdkcore", cls.__qualname__)
        """
    )
    assert out.split() == ["sdkcore", name]


def test_hedge_checks_its_policy_before_the_policy_module_is_loaded() -> None:
    """``hedge()`` tells a wrong policy without importing the HedgePolicy module, and a
    hedged request once ``sdkcore.HedgePolicy`` was used works in the same process."""
    out = run(
        """
        import asyncio, sys
        import sdkcore

        async def send(request, index):
            return index

        async def main():
            orchestrator = sdkcore.RetryOrchestrator()
            request = sdkcore.Request(idempotent=True, timeout=5)
            try:
                await orchestrator.hedge(request, send, {"max_attempts": 2})
            except TypeError as exc:
                print(exc)
            print("sdkcore._hedge_policy" in sys.modules, request.state.value)
            policy = sdkcore.HedgePolicy(max_attempts=2, delay=0.5)
            print(await orchestrator.hedge(request, send, policy), request.state.value)

        asyncio.run(main())
        """
    )
    refused, not_loaded, answered = out.splitlines()
    assert refused == (
        "hedge(request, send, policy): policy must be an sdkcore.HedgePolicy, "
        "got {'max_attempts': 2}"
    )
    assert not_loaded == "False pending"
    assert answered == "0 succeeded"


def test_from_sdkcore_import_loads_a_lazy_class() -> None:
    out = run(
        """
        from sdkcore import CircuitBreaker, CircuitState
        print(CircuitBreaker.__module__, CircuitState.__module__, CircuitState.OPEN)
        """
    )
    assert out.split() == ["sdkcore", "sdkcore", "CircuitState.OPEN"]


def test_a_lazy_value_object_pickles_to_a_fresh_process() -> None:
    """Pickled here (``sdkcore.CircuitState``), loaded where nothing has touched it yet."""
    data = pickle.dumps(sdkcore.CircuitState.OPEN)
    assert b"sdkcore" in data
    assert b"_breaker" not in data
    assert pickle.loads(data) is sdkcore.CircuitState.OPEN
    out = run(
        f"""
        import pickle, sys
        state = pickle.loads({data!r})
        import sdkcore
        assert state is sdkcore.CircuitState.OPEN, state
        print(type(state).__module__, state.value)
        """
    )
    assert out.split() == ["sdkcore", "open"]


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'sdkcore' has no attribute 'NoSuchThing'$"):
        sdkcore.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(sdkcore, "RequestTrace")  # private classes stay private
    with pytest.raises(ImportError, match="cannot import name 'NoSuchThing' from 'sdkcore'"):
        from sdkcore import NoSuchThing  # type: ignore[attr-defined]  # noqa: F401


TYPED_USE = """
import sdkcore
from sdkcore import CircuitBreaker, Telemetry

breaker: CircuitBreaker = sdkcore.CircuitBreaker(name="kv")
state: sdkcore.CircuitState = breaker.state
telemetry: Telemetry | None = None
reveal_type(sdkcore.RetryBudget().try_withdraw())
typo = sdkcore.CircuitBraker
"""


def test_type_checkers_see_the_lazy_classes_and_flag_unknown_names(tmp_path: Path) -> None:
    """The module ``__getattr__`` is hidden from type checkers: ``sdkcore.Typo`` stays an error."""
    pytest.importorskip("mypy")
    user = tmp_path / "user.py"
    user.write_text(TYPED_USE)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(user)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line.split(":", 1)[1] for line in done.stdout.splitlines()]
    assert len(lines) == 2, done.stdout + done.stderr
    # a RetryBudget's method is typed (not Any from a module __getattr__)
    assert lines[0] in (
        '8: note: Revealed type is "bool"',
        '8: note: Revealed type is "builtins.bool"',
    )
    assert lines[1].startswith('9: error: Module has no attribute "CircuitBraker"')


# -- logging: attached once the application imported it ---------------------------------------


def test_logging_imported_after_sdkcore_sees_every_event() -> None:
    """An application that configures ``logging`` after ``import sdkcore`` sees its events."""
    out = run(
        """
        import sys
        import sdkcore
        assert "logging" not in sys.modules
        import logging
        seen = []

        class Keep(logging.Handler):
            def emit(self, record):
                seen.append((record.levelname, record.getMessage().split(" ", 1)[0]))

        logger = logging.getLogger("sdkcore")
        logger.addHandler(Keep())
        logger.setLevel(logging.DEBUG)
        """,
        SYNC_REQUESTS,
        """
        print(sorted(set(seen)))
        print([type(h).__name__ for h in logger.handlers])
        """,
    )
    events, handlers = out.splitlines()
    assert events == "[('DEBUG', 'retry.scheduled'), ('WARNING', 'retry.strategy_failed')]"
    assert handlers == "['Keep', 'NullHandler']"


def test_logging_imported_after_sdkcore_but_unconfigured_prints_nothing() -> None:
    """No ``logging.lastResort``: the NullHandler is there before the first event."""
    out = run(
        """
        import sys
        import sdkcore
        import logging
        assert logging.getLogger("sdkcore").handlers == []  # nothing asked for an event yet
        """,
        SYNC_REQUESTS,
        """
        print([type(h).__name__ for h in logging.getLogger("sdkcore").handlers])
        """,
    )
    assert out.strip() == "['NullHandler']"  # and run() checked that stderr is empty


@pytest.mark.parametrize("first", ["logging", "asyncio", "trio"])
def test_logging_imported_before_sdkcore_gets_the_null_handler_at_import(first: str) -> None:
    out = run(
        f"""
        import {first}
        import logging
        import sdkcore
        print([type(h).__name__ for h in logging.getLogger("sdkcore").handlers])
        """
    )
    assert out.strip() == "['NullHandler']"


def test_structlog_on_the_stdlib_after_sdkcore_prints_nothing_unconfigured() -> None:
    """structlog routed to stdlib loggers, ``logging`` itself left unconfigured: the
    ``sdkcore`` logger has its NullHandler before the first event (no lastResort)."""
    out = run(
        """
        import sys
        import sdkcore
        import structlog
        structlog.configure(
            processors=[structlog.stdlib.render_to_log_kwargs],
            wrapper_class=structlog.stdlib.BoundLogger,
            logger_factory=structlog.stdlib.LoggerFactory(),
        )
        """,
        SYNC_REQUESTS,
        """
        import logging
        print([type(h).__name__ for h in logging.getLogger("sdkcore").handlers])
        """,
    )
    assert out.strip() == "['NullHandler']"  # and run() checked that stderr is empty
