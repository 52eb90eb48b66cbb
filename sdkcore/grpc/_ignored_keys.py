"""The keys of a gRPC service config that sdkcore ignores, found in its decoded JSON.

A6 ignores unknown keys (a service config must keep working when a newer gRPC adds
fields), which lets a typo (``retryPolicyy``) turn retries off without a word. The
same walk serves ``sdkcore check-config`` (its "unknown key, ignored" warnings,
``sdkcore._check_config``) and the channels, which log one ``grpc.config_ignored``
warning when they are made with such a config (rfc/0003, "Config events").

Pure Python, no grpc; ``difflib`` is imported only when an unknown key is found.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "HEDGING",
    "METHOD",
    "NAME",
    "RETRY",
    "ROOT",
    "THROTTLING",
    "UNKNOWN",
    "UNSUPPORTED",
    "IgnoredKey",
    "ignored_keys",
    "unknown_keys",
]

# The keys of the gRPC service config that sdkcore knows (the ones it reads, and the
# ones other parts of gRPC read, which are valid and ignored here).
ROOT = frozenset({"methodConfig", "retryThrottling", "loadBalancingConfig", "loadBalancingPolicy",
                  "healthCheckConfig"})  # fmt: skip
METHOD = frozenset({"name", "waitForReady", "timeout", "maxRequestMessageBytes",
                    "maxResponseMessageBytes", "retryPolicy", "hedgingPolicy"})  # fmt: skip
NAME = frozenset({"service", "method"})
RETRY = frozenset({"maxAttempts", "initialBackoff", "maxBackoff", "backoffMultiplier",
                   "retryableStatusCodes", "perAttemptRecvTimeout"})  # fmt: skip
HEDGING = frozenset({"maxAttempts", "hedgingDelay", "nonFatalStatusCodes"})
THROTTLING = frozenset({"maxTokens", "tokenRatio"})

#: :attr:`IgnoredKey.why` of a key gRPC's service config does not have.
UNKNOWN = "unknown key"
#: :attr:`IgnoredKey.why` of a valid key sdkcore's channels do not apply
#: (``retryPolicy.perAttemptRecvTimeout``; rfc/0003, "Not done here").
UNSUPPORTED = "not supported by sdkcore channels"

#: Unknown keys longer than this are shortened in paths (the middle is elided), and not
#: matched for a suggestion.
_KEY_SHOWN = 60


class IgnoredKey(NamedTuple):
    """One key of a service config that nothing applies."""

    #: Its JSON path, e.g. ``methodConfig[0].retryPolicyy`` (a long key shortened).
    path: str
    #: The key probably meant (a close match, or the camelCase of a snake_case key);
    #: None when there is no guess.
    suggestion: str | None
    #: :data:`UNKNOWN` or :data:`UNSUPPORTED`.
    why: str
    #: The suggestion is the key in camelCase (``max_attempts``: ``maxAttempts``).
    camel_case: bool = False


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _key(key: object) -> str:
    text = str(key)
    if len(text) > _KEY_SHOWN:
        half = _KEY_SHOWN // 2 - 2
        text = f"{text[:half]}...{text[-half:]}"
    return text


def unknown_keys(path: str, obj: Mapping[Any, Any], known: frozenset[str]) -> list[IgnoredKey]:
    """The keys of ``obj`` (at JSON path ``path``) that are not in ``known``."""
    out = []
    for key in obj:
        if key in known:
            continue
        where = f"{path}.{_key(key)}" if path else _key(key)
        if isinstance(key, str) and "_" in key and _camel(key) in known:
            out.append(IgnoredKey(where, _camel(key), UNKNOWN, camel_case=True))
            continue
        suggestion = None
        if len(str(key)) <= _KEY_SHOWN:
            import difflib  # only for a config with an unknown key

            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.75)
            suggestion = close[0] if close else None
        out.append(IgnoredKey(where, suggestion, UNKNOWN))
    return out


def ignored_keys(obj: Any) -> tuple[IgnoredKey, ...]:
    """Every key of the decoded service config ``obj`` that nothing applies, in file order
    per object: unknown keys, and ``perAttemptRecvTimeout`` (valid, not supported)."""
    if not isinstance(obj, Mapping):
        return ()
    out = unknown_keys("", obj, ROOT)
    mcs = obj.get("methodConfig")
    for i, mc in enumerate(mcs if isinstance(mcs, list) else []):
        if not isinstance(mc, Mapping):
            continue
        path = f"methodConfig[{i}]"
        out += unknown_keys(path, mc, METHOD)
        names = mc.get("name")
        for j, name in enumerate(names if isinstance(names, list) else []):
            if isinstance(name, Mapping):
                out += unknown_keys(f"{path}.name[{j}]", name, NAME)
        retry = mc.get("retryPolicy")
        if isinstance(retry, Mapping):
            out += unknown_keys(f"{path}.retryPolicy", retry, RETRY)
            if "perAttemptRecvTimeout" in retry:
                out.append(
                    IgnoredKey(f"{path}.retryPolicy.perAttemptRecvTimeout", None, UNSUPPORTED)
                )
        hedging = mc.get("hedgingPolicy")
        if isinstance(hedging, Mapping):
            out += unknown_keys(f"{path}.hedgingPolicy", hedging, HEDGING)
    throttling = obj.get("retryThrottling")
    if isinstance(throttling, Mapping):
        out += unknown_keys("retryThrottling", throttling, THROTTLING)
    return tuple(out)
