"""Redis history store: one list per user, atomic append + trim + TTL, bounded retries, short timeouts.

Each ``append`` is ONE MULTI/EXEC transaction (RPUSH, LTRIM to the newest ``max_len``, EXPIRE, LLEN), so
concurrent writers never observe or leave an untrimmed list. Connections come from a blocking pool; a broken
connection is dropped and the next attempt opens a new one, so the store recovers by itself when Redis comes
back. Every backend failure surfaces as :class:`HistoryStoreUnavailable`.

Retries: reads retry on connection errors and timeouts; appends retry only on connection errors (almost always
the transaction never reached Redis), not on timeouts, which may hide an applied transaction. An acknowledged
append is in Redis; in the rare reset-after-EXEC case a retried append may store the items twice (at least
once, never lost).

``wait``: with a :class:`WaitPolicy` (a Redis with replicas), an append is the Lua script of
:mod:`.redis_append` followed by ``WAIT`` on the same connection, and is acknowledged only once that many
replicas have it (:class:`WriteNotReplicated` otherwise, never retried).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from .redis_append import append_script
from .redis_base import RedisStoreBase


class RedisHistoryStore(RedisStoreBase):
    """History lists under ``{prefix}{user_id}`` in the Redis at ``url`` (``redis://host:port/db``)."""

    def __init__(self, url: str, *, retries: int = 2, pool_timeout_s: float = 1.0, **settings: Any) -> None:
        """``retries``: further attempts after a failed call; ``pool_timeout_s``: longest wait for a free pooled
        connection; ``settings``: :class:`RedisStoreBase`'s."""
        if retries < 0:
            raise ValueError("retries must be >= 0")
        super().__init__(**settings)
        self.url = url
        self.retries = retries
        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            timeout=pool_timeout_s,
            retry=Retry(NoBackoff(), 0),  # retries are ours (RedisStoreBase._call), with the append/timeout rule
            **self.client_options(),
        )
        self._client = redis.Redis(connection_pool=self._pool)

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except RedisError:
            return False

    def close(self) -> None:
        self._pool.disconnect()

    def _connection(self) -> redis.Redis:
        return self._client

    def _write(self, client: redis.Redis, key: str, values: list[int]) -> int:
        if self.wait is not None:
            return append_script(client, key, values, max_len=self.max_len, ttl_s=self.ttl_s, wait=self.wait)
        with client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, *values)
            pipe.ltrim(key, -self.max_len, -1)
            pipe.expire(key, self.ttl_s)
            pipe.llen(key)
            return int(pipe.execute()[-1])

    def _retry_left(self, attempt: int, delay: float, deadline: float | None) -> bool:
        return attempt <= self.retries
