"""Without memcached: skip locally naming the install command; fail under CI=true."""

from __future__ import annotations

import shutil

import memcached_server
import pytest


def test_missing_memcached_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install memcached"):
        memcached_server.memcached_binary()


def test_missing_memcached_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        memcached_server.memcached_binary()


def test_present_memcached_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setenv("CI", "true")
    assert memcached_server.memcached_binary() == "/opt/bin/memcached"
