"""argparse value types of ``recsvc serve``'s flags (and of the engine flags in ``settings``): each returns the
parsed value or raises ``argparse.ArgumentTypeError`` with what was expected, so a bad flag is a usage error.
``add_history_flags`` is the flag pair that ``recsvc serve`` and ``recsvc eval`` share."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
REDIS_SCHEMES = ("redis", "rediss", "unix")


def _parsed(text: str, cast, kind: str):
    """``cast(text)`` or the argparse error "not <kind>: 'text'" (the shared half of the types below)."""
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None


def port_number(text: str) -> int:
    """argparse type: a TCP port 0..65535 (0 = any free port)."""
    value = _parsed(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535 (0 = any free port), got {value}")
    return value


def positive_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (any case), got {text!r}")
    return level


def redis_url(text: str) -> str:
    """argparse type: redis://[user:password@]host[:port][/db], rediss://... (TLS), unix:///path, or a Redis
    Cluster: redis+cluster://host:port[,host:port...] (rediss+cluster:// with TLS)."""
    from recsvc.service.stores.redis_urls import is_cluster_url, parse_cluster_url

    if is_cluster_url(text):
        try:
            parse_cluster_url(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError when out of range / not a number
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a valid Redis URL {text!r}: {exc}") from None
    if parts.scheme not in REDIS_SCHEMES:
        raise argparse.ArgumentTypeError(
            f"expected redis://host:port/db, rediss://..., unix:///path or redis+cluster://host:port[,...], "
            f"got {text!r}"
        )
    if parts.scheme == "unix" and not parts.path:
        raise argparse.ArgumentTypeError(f"a unix:// Redis URL needs a socket path, got {text!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise argparse.ArgumentTypeError(f"a Redis URL needs a host, got {text!r}")
    db = parts.path.lstrip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise argparse.ArgumentTypeError(f"the Redis database must be a number, got {db!r} in {text!r}")
    del port
    return text


def add_history_flags(p: argparse.ArgumentParser, exclude_help: str, keep_help: str) -> None:
    """``--exclude-history`` / ``--keep-history`` (mutually exclusive) into ``args.exclude_history``: True / False,
    or None when neither is given (the bundle's choice: ``Bundle.excludes_history``)."""
    history = p.add_mutually_exclusive_group()
    history.add_argument("--exclude-history", action="store_const", const=True, dest="exclude_history", default=None,
                         help=exclude_help)
    history.add_argument("--keep-history", action="store_const", const=False, dest="exclude_history", help=keep_help)
