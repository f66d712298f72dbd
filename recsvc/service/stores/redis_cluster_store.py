"""Redis Cluster history store: redis-py's :class:`redis.cluster.RedisCluster`, one list per user on one slot.

Keys carry the user id as a hash tag, ``{prefix}{{user_id}}`` (``recsvc:hist:{alice}``), so everything
stored for a user hashes to one slot, served by one master (and its replicas). A standalone store names the
same history ``recsvc:hist:alice``: moving data between the two means renaming keys (README, "Redis Cluster").

Reads are LRANGEs through the cluster client (it follows MOVED redirections and refreshes its slot map after a
connection error). An append runs the Lua script of :mod:`.redis_append` on the master that owns the user's
slot, plus ``WAIT`` on the same connection when a :class:`WaitPolicy` is set (never acknowledged with fewer
replicas: :class:`WriteNotReplicated`, UNAVAILABLE to the caller).

Failover: a call that fails with a connection error or a cluster error (CLUSTERDOWN, TRYAGAIN, MASTERDOWN, a
slot without a master, MOVED) refreshes the slot map and is retried with exponential backoff until
``retry_budget_s`` has passed, then raises :class:`HistoryStoreUnavailable`; appends are not retried after a
timeout (it may hide an applied append) nor after a WAIT shortfall. When a replica has taken over, the refreshed
map points at it and calls succeed again, without a restart. The cluster client is created lazily, so a server
started while the cluster is unreachable serves inline-history requests and connects when it comes back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .base import HistoryStore, HistoryStoreUnavailable
from .redis_append import WaitPolicy, append_script
from .redis_urls import parse_cluster_url, redacted

log = logging.getLogger(__name__)
T = TypeVar("T")
# a failover in progress: refresh the slot map, back off, try again
FAILOVER_ERRORS = (
    RedisConnectionError,
    ClusterDownError,
    TryAgainError,
    MasterDownError,
    SlotNotCoveredError,
    MovedError,
    ClusterError,
    RedisClusterException,
)


class RedisClusterHistoryStore(HistoryStore):
    """History lists under ``{prefix}{{user_id}}`` in the cluster named by ``url`` (``redis+cluster://``)."""

    def __init__(
        self,
        url: str,
        *,
        max_len: int = 200,
        ttl_s: int = 90 * 24 * 3600,
        prefix: str = "recsvc:hist:",
        wait: WaitPolicy | None = None,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.25,
        retry_budget_s: float = 1.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 0.4,
        max_connections: int = 64,
    ) -> None:
        if max_len < 1 or ttl_s < 1 or retry_budget_s < 0:
            raise ValueError("max_len and ttl_s must be >= 1 and retry_budget_s >= 0")
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a Redis Cluster key prefix cannot contain '{{' or '}}' (the hash tag is the user id), "
                             f"got {prefix!r}")
        self.cluster_url = parse_cluster_url(url)
        self.url = redacted(url)
        self.max_len = max_len
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.wait = wait
        self.retry_budget_s = retry_budget_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        # WAIT blocks the connection up to its timeout: the socket must wait longer than WAIT does
        wait_s = wait.timeout_ms / 1000.0 if wait else 0.0
        self._options = {
            "socket_timeout": max(socket_timeout_s, wait_s + 0.25),
            "socket_connect_timeout": connect_timeout_s,
            "max_connections": max_connections,
            "username": self.cluster_url.username,
            "password": self.cluster_url.password,
            "ssl": self.cluster_url.ssl,
            "client_name": "recsvc",
        }
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        self._closed = False

    def key(self, user_id: str) -> str:
        return f"{self.prefix}{{{user_id}}}"

    # --- HistoryStore ------------------------------------------------------------------------------------

    def append(self, user_id: str, items: Sequence[int]) -> int:
        values = [int(item) for item in items]
        if not values:
            return len(self.get(user_id))
        key = self.key(user_id)

        def write(cluster: RedisCluster) -> int:
            def run(node: ClusterNode, asking: bool = False) -> int:
                return append_script(cluster.get_redis_connection(node), key, values, max_len=self.max_len,
                                     ttl_s=self.ttl_s, wait=self.wait, asking=asking)

            try:
                return run(cluster.get_node_from_key(key))
            except AskError as exc:
                if isinstance(exc, MovedError):
                    raise  # the slot map is stale: refreshed, then retried
                target = cluster.get_node(exc.host, exc.port)  # the slot is migrating to this node
                if target is None:
                    raise TryAgainError(f"ASK to unknown node {exc.host}:{exc.port}") from exc
                return run(target, asking=True)

        return self._call("append", write, retry_on_timeout=False)

    def get(self, user_id: str) -> list[int]:
        key = self.key(user_id)
        raw = self._call("get", lambda cluster: cluster.lrange(key, 0, -1), retry_on_timeout=True)
        return [int(value) for value in raw]

    def ttl(self, user_id: str) -> int:
        """Seconds until the user's history expires (-2: no such key, -1: no TTL)."""
        key = self.key(user_id)
        return int(self._call("ttl", lambda cluster: cluster.ttl(key), retry_on_timeout=True))

    def ping(self) -> bool:
        """Every master answers (a shard without a reachable master is a degraded store)."""
        try:
            cluster = self._client()
            return bool(cluster.ping(target_nodes=RedisCluster.PRIMARIES))
        except (RedisError, RedisClusterException):
            self._refresh()
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()

    # --- plumbing ----------------------------------------------------------------------------------------

    def _client(self) -> RedisCluster:
        """The cluster client, created on first use (RedisClusterException while no seed answers)."""
        with self._lock:
            if self._closed:
                raise RedisClusterException("the store is closed")
            if self._cluster is None:
                self._cluster = RedisCluster(
                    startup_nodes=[ClusterNode(host, port) for host, port in self.cluster_url.nodes],
                    require_full_coverage=False,  # the other shards serve while one fails over
                    retry=Retry(NoBackoff(), 1),  # one immediate retry after its own slot-map refresh; then ours
                    **self._options,
                )
            return self._cluster

    def _refresh(self) -> None:
        """Re-reads the slot map from any reachable node (concurrent refreshes are merged by redis-py). When no
        known node answers, the client is dropped: the next call starts again from the configured seeds, with
        their host names resolved again (a cluster whose nodes all came back on new addresses)."""
        with self._lock:
            cluster = self._cluster
        if cluster is None:
            return
        try:
            cluster.nodes_manager.initialize()
        except (RedisError, RedisClusterException) as exc:
            log.debug("redis cluster slot map refresh failed: %s; reconnecting from the seeds", exc)
            with self._lock:
                if self._cluster is cluster:
                    self._cluster = None
            cluster.close()

    def _call(self, op: str, fn: Callable[[RedisCluster], T], *, retry_on_timeout: bool) -> T:
        deadline = time.monotonic() + self.retry_budget_s
        delay = self.backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn(self._client())
            except HistoryStoreUnavailable:
                raise  # a WAIT shortfall: the append reached the master, never retried
            except RedisTimeoutError as exc:
                if not retry_on_timeout or time.monotonic() + delay > deadline:
                    raise HistoryStoreUnavailable(f"redis cluster {op} failed: {_describe(exc)}") from exc
                error: Exception = exc
            except FAILOVER_ERRORS as exc:
                if time.monotonic() + delay > deadline:
                    raise HistoryStoreUnavailable(
                        f"redis cluster {op} failed after {attempt} attempts: {_describe(exc)}"
                    ) from exc
                error = exc
            except RedisError as exc:
                raise HistoryStoreUnavailable(f"redis cluster {op} failed: {_describe(exc)}") from exc
            log.debug("redis cluster %s failed (attempt %d): %s; retrying", op, attempt, error)
            self._refresh()
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
