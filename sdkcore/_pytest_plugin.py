"""The ``sdkcore`` pytest plugin (registered through the ``pytest11`` entry point).

Fixtures:

* ``sdkcore_instant_retries``: the test runs inside :func:`sdkcore.testing.instant_retries`.
* ``sdkcore_retry_events``: the list of sdkcore log events emitted during the test
  (:func:`sdkcore.testing.capture_retry_events`).

``sdkcore.testing`` (and the mapping and gRPC modules it uses) is imported only when a
test asks for one of these fixtures, so the plugin adds little to other test sessions.
Disable it with ``-p no:sdkcore``.
"""

from __future__ import annotations

import os
from collections.abc import Generator, MutableMapping
from typing import Any

import pytest

# grpc core logs at INFO unless GRPC_VERBOSITY says otherwise, and reads it once, when
# grpc is imported: set its documented default (ERROR) before any test module imports
# grpc, so in-process test servers (sdkcore.testing.grpc_server) print nothing on
# stderr. A value the user set is kept.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__all__ = ["sdkcore_instant_retries", "sdkcore_retry_events"]


@pytest.fixture
def sdkcore_instant_retries() -> Generator[None, None, None]:
    """Every sdkcore retry delay is waited as zero during the test (decisions unchanged)."""
    from sdkcore.testing import instant_retries

    with instant_retries():
        yield


@pytest.fixture
def sdkcore_retry_events() -> Generator[list[MutableMapping[str, Any]], None, None]:
    """The sdkcore log events emitted during the test, as dicts (``event``, ``log_level``, ...)."""
    from sdkcore.testing import capture_retry_events

    with capture_retry_events() as events:
        yield events
