"""Redis Cluster history store: redis-py's :class:`redis.cluster.RedisCluster`, one list per user on one slot.

Keys carry the user id as a hash tag, ``{prefix}{{user_id}}`` (``recsvc:hist:{alice}``), so everything
stored for a user hashes to one slot, served by one master (and its replicas). A standalone store names the
same history ``recsvc:hist:alice``: moving data between the two means renaming keys (deploy/README.md,
"Running with a Redis Cluster").

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
from typing import Any

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
from redis.retry import Retry

from .redis_append import append_script
from .redis_base import RedisStoreBase
from .redis_urls import parse_cluster_url, redacted

log = logging.getLogger(__name__)
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


class RedisClusterHistoryStore(RedisStoreBase):
    """History lists under ``{prefix}{{user_id}}`` in the cluster named by ``url`` (``redis+cluster://``)."""

    label = "redis cluster"
    RETRIABLE = FAILOVER_ERRORS

    def __init__(self, url: str, *, retry_budget_s: float = 1.0, max_backoff_s: float = 0.4, **settings: Any) -> None:
        """``retry_budget_s``: how long a failing call keeps retrying; ``settings``: :class:`RedisStoreBase`'s."""
        if retry_budget_s < 0:
            raise ValueError("retry_budget_s must be >= 0")
        super().__init__(max_backoff_s=max_backoff_s, **settings)
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"a Redis Cluster key prefix cannot contain '{{' or '}}' (the hash tag is the user id), "
                             f"got {self.prefix!r}")
        self.cluster_url = parse_cluster_url(url)
        self.url = redacted(url)
        self.retry_budget_s = retry_budget_s
        self._options = {
            **self.client_options(),
            "username": self.cluster_url.username,
            "password": self.cluster_url.password,
            "ssl": self.cluster_url.ssl,
        }
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        self._closed = False

    def key(self, user_id: str) -> str:
        return f"{self.prefix}{{{user_id}}}"

    # --- HistoryStore (append, get, ttl: RedisStoreBase) --------------------------------------------------

    def ping(self) -> bool:
        """Every master answers (a shard without a reachable master is a degraded store)."""
        try:
            cluster = self._connection()
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

    def _write(self, cluster: RedisCluster, key: str, values: list[int]) -> int:
        """The append on the master that owns the key's slot (following an ASK to a slot being migrated)."""

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

    def _deadline(self) -> float | None:
        return time.monotonic() + self.retry_budget_s

    def _retry_left(self, attempt: int, delay: float, deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() + delay <= deadline

    def _after_failure(self) -> None:
        self._refresh()

    def _connection(self) -> RedisCluster:
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
