"""The ``--redis-url`` forms: one Redis (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster.

A cluster URL names the cluster with its seed nodes (any reachable one is enough; the client discovers the
others and the slot map from it)::

    redis+cluster://[user:password@]host:port[,host:port...]      plaintext
    rediss+cluster://[user:password@]host:port[,host:port...]     TLS

The path may be empty or ``/0`` (a cluster has database 0 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class ClusterURL:
    """A parsed cluster URL: seed nodes, credentials, TLS."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def is_cluster_url(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterURL:
    """ValueError (with what is wrong) for anything but ``redis+cluster://`` / ``rediss+cluster://`` URLs."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"expected redis+cluster://host:port[,host:port...], got {url!r}")
    netloc, _, tail = rest.partition("/")
    path = tail.split("?", 1)[0].split("#", 1)[0]
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only, got /{path} in {url!r}")
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    nodes = tuple(_host_port(part.strip(), url) for part in netloc.split(",") if part.strip())
    if not nodes:
        raise ValueError(f"a Redis Cluster URL needs at least one host:port, got {url!r}")
    return ClusterURL(nodes, username, password, scheme.lower() == "rediss+cluster")


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port_text = text[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"a node without a host ({text!r}) in {url!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"not a port 1..65535: {port_text!r} in {url!r}")
    return host, int(port_text)


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    userinfo, _, hosts = netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if has_password else ''}@{hosts}{slash}{tail}"
