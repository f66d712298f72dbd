"""Prometheus metrics of one server instance (own registry, exported on a separate HTTP port)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from recsvc.errors import UserError

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServiceMetrics:
    """Request latency by method, requests/errors by code, batch sizes, engine work counters, process stats."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes, process_cpu_seconds_total, process_start_time_seconds,
        # process_open_fds, ... (Linux /proc; silently empty elsewhere)
        ProcessCollector(registry=r)
        self.latency = Histogram(
            "recsvc_request_latency_seconds",
            "Server-side latency per RPC",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "recsvc_requests", "RPCs by method and status code", ["method", "code"], registry=r
        )
        self.errors = Counter(
            "recsvc_errors", "Failed RPCs by method and status code", ["method", "code"], registry=r
        )
        self.batch_size = Histogram(
            "recsvc_batch_size", "Queries per engine call", buckets=_BATCH_BUCKETS, registry=r
        )
        self.engine_seconds = Histogram(
            "recsvc_engine_call_seconds", "Duration of one engine call", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.target_calls = Counter("recsvc_target_forward_calls", "Target model forward calls", registry=r)
        self.draft_calls = Counter("recsvc_draft_forward_calls", "Drafter forward calls", registry=r)
        self.accepted_steps = Counter("recsvc_accepted_steps", "Accepted speculative draft steps", registry=r)
        self.host_reads = Counter("recsvc_host_reads", "Device-to-host reads of sampled engine calls (per request "
                                  "answered from one; --count-host-reads)", registry=r)
        self.modes = Counter(
            "recsvc_recommend_modes",
            "Recommend requests answered, by decoding mode used (plain, strict, relaxed, sampling, popularity) and "
            "mode requested (plain, strict, relaxed)",
            ["mode", "requested"],
            registry=r,
        )
        self.rejected = Counter(
            "recsvc_rejected",
            "RPCs turned away before any work: reason starting (the engine is loading), overloaded (queue full), "
            "closing (draining); logged at most once a second per method and reason, with a count",
            ["method", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "recsvc_fallbacks", "Requests answered by a fallback", ["reason"], registry=r
        )
        self.expired = Counter(
            "recsvc_expired_in_queue",
            "Queries dropped before the engine call: deadline passed or RPC cancelled before or while queued",
            ["reason"],  # deadline | cancelled
            registry=r,
        )
        self.queue_depth = Gauge("recsvc_queue_depth", "Queries waiting for the engine", registry=r)
        self.store_errors = Counter(
            "recsvc_history_store_errors", "History store failures", ["operation"], registry=r
        )
        self.state_cache_source = lambda: None  # -> the served recommender's UserStateCache (or None)
        r.register(_StateCacheCollector(self))
        self._http = None

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts /metrics in a daemon thread; returns the bound port (``port=0`` picks a free one)."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise UserError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _StateCacheCollector:
    """The user-state cache's counters (recsvc.engine.caches.state_cache), read at scrape time from the recommender
    being served (a reload serves a new, empty cache: the counters start again)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        cache = self.metrics.state_cache_source()
        stats = cache.stats() if cache is not None else {}
        for name, help_text in (("hits", "Prompts found whole in the user-state cache"),
                                ("partial_hits", "Prompts extending a cached prompt (only new tokens run)"),
                                ("misses", "Prompts run in full"),
                                ("evictions", "Entries evicted by the byte budget"),
                                ("row_hits", "Keyed rows found (the item-level target's timeline states and "
                                             "search outputs)"),
                                ("row_misses", "Keyed rows not found")):
            yield CounterMetricFamily(f"recsvc_state_cache_{name}", help_text, value=stats.get(name, 0))
        yield GaugeMetricFamily("recsvc_state_cache_bytes", "Bytes held by the user-state cache",
                                value=stats.get("bytes", 0))
        yield GaugeMetricFamily("recsvc_state_cache_entries", "Users' prompts in the user-state cache",
                                value=stats.get("entries", 0))
        yield GaugeMetricFamily("recsvc_state_cache_row_bytes", "Bytes held by the user-state cache's keyed rows",
                                value=stats.get("row_bytes", 0))
