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

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .base import HistoryStore, HistoryStoreUnavailable
from .redis_append import WaitPolicy, append_script

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisHistoryStore(HistoryStore):
    """History lists under ``{prefix}{user_id}`` in the Redis at ``url`` (``redis://host:port/db``)."""

    def __init__(
        self,
        url: str,
        *,
        max_len: int = 200,
        ttl_s: int = 90 * 24 * 3600,
        prefix: str = "recsvc:hist:",
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.25,
        retries: int = 2,
        backoff_s: float = 0.05,
        max_backoff_s: float = 0.5,
        max_connections: int = 64,
        pool_timeout_s: float = 1.0,
        wait: WaitPolicy | None = None,
    ) -> None:
        if max_len < 1 or ttl_s < 1 or retries < 0:
            raise ValueError("max_len and ttl_s must be >= 1 and retries >= 0")
        self.url = url
        self.max_len = max_len
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.wait = wait
        if wait is not None:  # WAIT blocks the connection up to its timeout: the socket must wait longer
            socket_timeout_s = max(socket_timeout_s, wait.timeout_ms / 1000.0 + 0.25)
        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),  # retries are ours (below), with the append/timeout rule
            client_name="recsvc",
        )
        self._client = redis.Redis(connection_pool=self._pool)

    def key(self, user_id: str) -> str:
        return f"{self.prefix}{user_id}"

    def append(self, user_id: str, items: Sequence[int]) -> int:
        values = [int(item) for item in items]
        if not values:
            return len(self.get(user_id))
        key = self.key(user_id)
        if self.wait is not None:
            return self._call("append", lambda: append_script(self._client, key, values, max_len=self.max_len,
                                                              ttl_s=self.ttl_s, wait=self.wait),
                              retry_on_timeout=False)

        def transaction() -> int:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.rpush(key, *values)
                pipe.ltrim(key, -self.max_len, -1)
                pipe.expire(key, self.ttl_s)
                pipe.llen(key)
                return int(pipe.execute()[-1])

        return self._call("append", transaction, retry_on_timeout=False)

    def get(self, user_id: str) -> list[int]:
        raw = self._call("get", lambda: self._client.lrange(self.key(user_id), 0, -1), retry_on_timeout=True)
        return [int(value) for value in raw]

    def ttl(self, user_id: str) -> int:
        """Seconds until the user's history expires (-2: no such key, -1: no TTL)."""
        return int(self._call("ttl", lambda: self._client.ttl(self.key(user_id)), retry_on_timeout=True))

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except RedisError:
            return False

    def close(self) -> None:
        self._pool.disconnect()

    def _call(self, op: str, fn: Callable[[], T], *, retry_on_timeout: bool) -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                retriable = isinstance(exc, RedisConnectionError) or retry_on_timeout
                if not retriable or attempt == self.retries:
                    raise HistoryStoreUnavailable(f"redis {op} failed: {_describe(exc)}") from exc
                log.debug("redis %s failed (attempt %d): %s; retrying", op, attempt + 1, exc)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            except RedisError as exc:
                raise HistoryStoreUnavailable(f"redis {op} failed: {_describe(exc)}") from exc
        raise AssertionError("unreachable")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
