"""The ``sdkcore`` pytest plugin (registered through the ``pytest11`` entry point).

Fixtures:

* ``sdkcore_instant_retries``: the test runs inside :func:`sdkcore.testing.instant_retries`.
* ``sdkcore_retry_events``: the list of sdkcore log events emitted during the test
  (:func:`sdkcore.testing.capture_retry_events`).
"""

from __future__ import annotations

from collections.abc import Generator, MutableMapping
from typing import Any

import pytest

from .testing import capture_retry_events, instant_retries

__all__ = ["sdkcore_instant_retries", "sdkcore_retry_events"]


@pytest.fixture
def sdkcore_instant_retries() -> Generator[None, None, None]:
    """Every sdkcore retry delay is waited as zero during the test (decisions unchanged)."""
    with instant_retries():
        yield


@pytest.fixture
def sdkcore_retry_events() -> Generator[list[MutableMapping[str, Any]], None, None]:
    """The sdkcore log events emitted during the test, as dicts (``event``, ``log_level``, ...)."""
    with capture_retry_events() as events:
        yield events
