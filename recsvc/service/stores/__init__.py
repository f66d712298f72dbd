"""User history stores: the :class:`HistoryStore` interface, an in-process store, a Redis store and a Redis
Cluster store."""

from __future__ import annotations

from .base import HistoryStore, HistoryStoreUnavailable
from .memory import InMemoryHistoryStore


def open_store(redis_url: str | None, *, max_len: int = 200, **redis_options) -> HistoryStore:
    """``None`` -> :class:`InMemoryHistoryStore`; ``redis+cluster://`` / ``rediss+cluster://`` ->
    :class:`RedisClusterHistoryStore`; any other Redis URL -> :class:`RedisHistoryStore`. ``redis_options``
    go to the store (``wait_replicas`` / ``wait_timeout_ms`` become its :class:`WaitPolicy`)."""
    if not redis_url:
        return InMemoryHistoryStore(max_len=max_len)
    from .redis_append import WaitPolicy
    from .redis_urls import is_cluster_url

    replicas = redis_options.pop("wait_replicas", 0) or 0
    timeout_ms = redis_options.pop("wait_timeout_ms", None) or 500
    if replicas:
        redis_options["wait"] = WaitPolicy(replicas, timeout_ms)
    if is_cluster_url(redis_url):
        from .redis_cluster_store import RedisClusterHistoryStore

        return RedisClusterHistoryStore(redis_url, max_len=max_len, **redis_options)
    from .redis_store import RedisHistoryStore

    return RedisHistoryStore(redis_url, max_len=max_len, **redis_options)


__all__ = ["HistoryStore", "HistoryStoreUnavailable", "InMemoryHistoryStore", "open_store"]
