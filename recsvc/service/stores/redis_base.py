"""What the standalone and the cluster Redis history stores share: their settings, the key-per-user calls
(append, get, ttl) and the one retry loop through which every backend failure becomes
:class:`HistoryStoreUnavailable`.

A subclass says how a call reaches Redis (``_connection``: a client), how an append is written (``_write``),
which errors are worth another attempt (``RETRIABLE``), how long to keep trying (``_retry_left``) and what to
do between attempts (``_after_failure``: the cluster refreshes its slot map).

Retry rule (both stores): reads retry on connection errors and timeouts; appends retry on connection errors
only, never after a timeout (it may hide an applied append) nor after a WAIT shortfall
(:class:`WriteNotReplicated`, which is already a :class:`HistoryStoreUnavailable`).
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .base import HistoryStore, HistoryStoreUnavailable
from .redis_append import WaitPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisStoreBase(HistoryStore):
    """One Redis list per user under ``key(user_id)``, trimmed to ``max_len`` items, expiring ``ttl_s`` seconds
    after its last append."""

    label = "redis"  # names the backend in errors and logs
    RETRIABLE: tuple[type[BaseException], ...] = (RedisConnectionError,)

    def __init__(
        self,
        *,
        max_len: int = 200,
        ttl_s: int = 90 * 24 * 3600,
        prefix: str = "recsvc:hist:",
        wait: WaitPolicy | None = None,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.25,
        backoff_s: float = 0.05,
        max_backoff_s: float = 0.5,
        max_connections: int = 64,
    ) -> None:
        """The settings both stores take (a subclass adds its own: how long to keep retrying, its pool)."""
        if max_len < 1 or ttl_s < 1:
            raise ValueError("max_len and ttl_s must be >= 1")
        self.max_len, self.ttl_s, self.prefix, self.wait = max_len, ttl_s, prefix, wait
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s  # the retry loop's first and longest waits
        # WAIT blocks the connection up to its timeout: the socket must wait longer than WAIT does
        self.socket_timeout_s = (socket_timeout_s if wait is None
                                 else max(socket_timeout_s, wait.timeout_ms / 1000.0 + 0.25))
        self.connect_timeout_s, self.max_connections = connect_timeout_s, max_connections

    def client_options(self) -> dict[str, Any]:
        """The redis-py connection options of both clients (timeouts, connection cap, client name)."""
        return {"socket_timeout": self.socket_timeout_s, "socket_connect_timeout": self.connect_timeout_s,
                "max_connections": self.max_connections, "client_name": "recsvc"}

    def key(self, user_id: str) -> str:
        return f"{self.prefix}{user_id}"

    # --- HistoryStore ------------------------------------------------------------------------------------

    def append(self, user_id: str, items: Sequence[int]) -> int:
        values = [int(item) for item in items]
        if not values:
            return len(self.get(user_id))
        key = self.key(user_id)
        return self._call("append", lambda client: self._write(client, key, values), retry_on_timeout=False)

    def get(self, user_id: str) -> list[int]:
        key = self.key(user_id)
        raw = self._call("get", lambda client: client.lrange(key, 0, -1), retry_on_timeout=True)
        return [int(value) for value in raw]

    def ttl(self, user_id: str) -> int:
        """Seconds until the user's history expires (-2: no such key, -1: no TTL)."""
        key = self.key(user_id)
        return int(self._call("ttl", lambda client: client.ttl(key), retry_on_timeout=True))

    # --- what a subclass provides --------------------------------------------------------------------------

    @abstractmethod
    def _connection(self) -> Any:
        """The client a call runs on (may raise one of ``RETRIABLE`` while the backend is unreachable)."""

    @abstractmethod
    def _write(self, client: Any, key: str, values: list[int]) -> int:
        """One atomic append of ``values`` to ``key`` (trim, TTL); returns the list's length."""

    @abstractmethod
    def _retry_left(self, attempt: int, delay: float, deadline: float | None) -> bool:
        """Whether a failed ``attempt`` (1-based) may be followed by another after sleeping ``delay`` seconds."""

    def _deadline(self) -> float | None:
        """When a call's retries must end (None: bounded by attempts instead)."""
        return None

    def _after_failure(self) -> None:
        """Runs after a retriable failure, before the back-off sleep."""

    # --- the retry loop ----------------------------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[Any], T], *, retry_on_timeout: bool) -> T:
        deadline = self._deadline()
        delay = self.backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn(self._connection())
            except HistoryStoreUnavailable:
                raise  # a WAIT shortfall: the append reached the master, never retried
            except RedisTimeoutError as exc:
                if not retry_on_timeout or not self._retry_left(attempt, delay, deadline):
                    raise self._unavailable(op, exc, attempt) from exc
                error: BaseException = exc
            except self.RETRIABLE as exc:
                if not self._retry_left(attempt, delay, deadline):
                    raise self._unavailable(op, exc, attempt) from exc
                error = exc
            except RedisError as exc:
                raise self._unavailable(op, exc, 1) from exc
            log.debug("%s %s failed (attempt %d): %s; retrying", self.label, op, attempt, error)
            self._after_failure()
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    def _unavailable(self, op: str, exc: BaseException, attempts: int) -> HistoryStoreUnavailable:
        after = f" after {attempts} attempts" if attempts > 1 else ""
        return HistoryStoreUnavailable(f"{self.label} {op} failed{after}: {describe(exc)}")


def describe(exc: BaseException) -> str:
    """An exception as one short line for a log (at most 200 characters)."""
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
