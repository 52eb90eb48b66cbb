"""A channel target as grpc C-core reads it: its canonical URI, and the server name in it.

A66's ``grpc.target`` is the canonical URI (:func:`canonical_target`); A6 throttles per
server name (:func:`server_name`), so ``127.0.0.1:50051``, ``dns:///127.0.0.1:50051``
and ``ipv4:127.0.0.1:50051`` share one token bucket, as they did in grpc C-core, which
keyed it on the canonical URI's path.
"""

from __future__ import annotations

import re

__all__ = ["canonical_target", "server_name"]

# grpc C-core's resolvers: a target naming one of them is already canonical.
_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds", "google-c2p"})
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def canonical_target(target: str) -> str:
    """A66's ``grpc.target``: the target URI with its scheme, as grpc C-core resolves it.

    A target naming a resolver (``dns:``, ``unix:``, ``ipv4:``, ``xds:`` ..., or any
    ``scheme://``) is kept as written; anything else gets grpc's default prefix,
    ``dns:///`` (``127.0.0.1:50051`` is ``dns:///127.0.0.1:50051``).
    """
    match = _SCHEME.match(target)
    if match is not None and (
        match.group(1).lower() in _SCHEMES or target.startswith("//", match.end())
    ):
        return target
    return "dns:///" + target


def server_name(target: str) -> str:
    """The server name A6 throttles by: the canonical target's path, without its scheme,
    its authority (``dns://8.8.8.8/host:443``'s DNS server) and leading slashes."""
    rest = canonical_target(target).partition(":")[2]
    if rest.startswith("//"):  # scheme://authority/path
        slash = rest.find("/", 2)
        rest = "" if slash < 0 else rest[slash:]
    return rest.lstrip("/")
