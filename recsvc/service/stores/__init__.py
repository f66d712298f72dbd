"""User history stores: the :class:`HistoryStore` interface, an in-process store and a Redis store."""

from __future__ import annotations

from .base import HistoryStore, HistoryStoreUnavailable
from .memory import InMemoryHistoryStore


def open_store(redis_url: str | None, *, max_len: int = 200, **redis_options) -> HistoryStore:
    """``None`` -> :class:`InMemoryHistoryStore`; a ``redis://`` URL -> :class:`RedisHistoryStore`."""
    if not redis_url:
        return InMemoryHistoryStore(max_len=max_len)
    from .redis_store import RedisHistoryStore

    return RedisHistoryStore(redis_url, max_len=max_len, **redis_options)


__all__ = ["HistoryStore", "HistoryStoreUnavailable", "InMemoryHistoryStore", "open_store"]
