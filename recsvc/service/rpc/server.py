"""The gRPC server: recommender + history store + batcher + health + reflection + metrics, with a clean drain.

Start one from Python with :func:`serve` (any object implementing :class:`recsvc.recommender.api.Recommender`)::

    server = serve(recommender, store=None, config=ServerConfig(port=0))  # started; server.port is bound
    ...
    server.stop(grace_s=5.0)  # stop accepting, finish in-flight RPCs, release everything

``recsvc serve`` (``recsvc/service/cli.py``) listens first, with health NOT_SERVING, while the engine loads
and calibrates (``RecServer(None, store, config).start()``, then :meth:`RecServer.attach`), and drains on
SIGTERM.

Health (``grpc.health.v1``): "" and "recsvc.v1.Recommender" are NOT_SERVING until the engine is attached and
while draining; "recsvc.v1.Recommender/history-store" follows the history store (probed every
``store_probe_s`` and on every store call): NOT_SERVING while it is unreachable. Health and reflection need
no API key.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from recsvc.errors import UserError
from recsvc.recommender.api import MODES, Mode, Recommender, RecQuery
from recsvc.service.observability.logs import log_event
from recsvc.service.observability.metrics import ServiceMetrics
from recsvc.service.stores import HistoryStore, InMemoryHistoryStore

from .batcher import Batcher
from .reflection import enable_server_reflection
from .security import ApiKeyInterceptor, server_credentials
from .servicer import SERVICE_NAME, RecommenderServicer
from .validation import Limits

log = logging.getLogger(__name__)
STORE_HEALTH_NAME = f"{SERVICE_NAME}/history-store"
MAX_PORT = 65535


def check_port(port: int | None, flag: str) -> None:
    """0..65535 (0 = a free port); UserError otherwise (grpc would silently wrap 99999 to 34463)."""
    if port is not None and not 0 <= port <= MAX_PORT:
        raise UserError(f"{flag} must be between 0 and {MAX_PORT} (0 = any free port), got {port}")


@dataclass
class ServerConfig:
    """Everything ``recsvc serve`` can set; the defaults suit tests (localhost, free port, no TLS/key)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 -> a free port (see RecServer.port)
    max_batch: int = 16
    max_wait_ms: float = 5.0
    max_queue: int = 1024  # queries waiting for the engine before RESOURCE_EXHAUSTED
    default_mode: Mode = "strict"
    limits: Limits = field(default_factory=Limits)
    max_message_bytes: int = 1 << 20
    api_key: str | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    metrics_port: int | None = None  # None -> no metrics endpoint; 0 -> a free port
    metrics_host: str = "127.0.0.1"
    workers: int = 64  # handler threads (each waiting RPC holds one)
    request_timeout_s: float = 30.0  # longest wait for the engine when the client set no deadline
    warmup: bool = True
    reflection: bool = True
    store_probe_s: float = 1.0  # history-store health probe period (0 = probe only on store calls)
    reuse_port: bool = False  # SO_REUSEPORT: several processes share the port (``recsvc serve --processes N``)

    def check(self) -> None:
        check_port(self.port, "port")
        check_port(self.metrics_port, "metrics port")
        if self.default_mode not in MODES:
            raise UserError(f"default mode must be one of {', '.join(MODES)} (got {self.default_mode!r})")
        if self.max_batch < 1 or self.max_wait_ms < 0 or self.max_queue < 1 or self.workers < 1:
            raise UserError("max batch, max queue and workers must be >= 1 and max wait >= 0")
        if self.limits.max_k < 1 or self.limits.max_history < 1:
            raise UserError("max k and max history must be >= 1")
        if self.max_message_bytes < 1024:
            raise UserError(f"max message bytes must be >= 1024 (got {self.max_message_bytes})")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise UserError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")


class RecServer:
    """One running service instance. Not restartable: build a new one after :meth:`stop`."""

    def __init__(
        self,
        recommender: Recommender | None,
        store: HistoryStore | None = None,
        config: ServerConfig | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        self.config.check()
        self.recommender = recommender
        self._owns_store = store is None
        self.store = (
            store if store is not None else InMemoryHistoryStore(max_len=self.config.limits.max_history)
        )
        self.metrics = ServiceMetrics()
        self.metrics.state_cache_source = lambda: self.recommender.states if self.recommender is not None else None
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.batcher: Batcher | None = None
        self.servicer: RecommenderServicer | None = None
        self._server: grpc.Server | None = None
        self.port: int = 0
        self.metrics_port: int | None = None
        self.ready = threading.Event()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._store_ok: bool | None = None
        self._probe_stop = threading.Event()
        self._probe: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` to dial (valid after :meth:`start`)."""
        return f"{self.config.host}:{self.port}"

    def start(self, **serving_fields) -> RecServer:
        """Listens (health NOT_SERVING) and, when the server was built with a recommender, attaches it (warm
        up, SERVING). Built with ``recommender=None``: call :meth:`attach` once the engine is loaded."""
        if self._server is not None:
            raise RuntimeError("server already started")
        try:
            self._listen()
            if self.recommender is not None:
                self.attach(self.recommender, **serving_fields)
        except BaseException:
            self._abort()
            raise
        return self

    def attach(self, recommender: Recommender, **serving_fields) -> None:
        """Warms ``recommender`` up, starts the batcher and turns health SERVING; ``serving_fields`` (e.g. the
        bundle and decoding settings) are added to the "serving" log line."""
        if self._server is None:
            raise RuntimeError("attach() needs a started server")
        if self.ready.is_set():
            raise RuntimeError("a recommender is already attached")
        cfg = self.config
        self.recommender = recommender
        if cfg.warmup:
            self._warm_up()
        self.batcher = Batcher(
            recommender,
            max_batch=cfg.max_batch,
            max_wait_s=cfg.max_wait_ms / 1000.0,
            max_queue=cfg.max_queue,
            metrics=self.metrics,
        )
        assert self.servicer is not None
        self.servicer.attach(recommender, self.batcher)
        if recommender.prefill_ahead_enabled:  # a user's prefill, ahead, when idle
            self.servicer.after_record = self._prefill_ahead
        self.probe_store()
        if cfg.store_probe_s > 0:
            self._probe = threading.Thread(target=self._probe_loop, name="recsvc-store-probe", daemon=True)
            self._probe.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.ready.set()
        log_event(
            log,
            "serving",
            address=self.address,
            port=self.port,
            tls=bool(cfg.tls_cert),
            api_key=bool(cfg.api_key),
            metrics_port=self.metrics_port,
            max_batch=cfg.max_batch,
            max_wait_ms=cfg.max_wait_ms,
            default_mode=cfg.default_mode,
            store=type(self.store).__name__,
            **serving_fields,
        )

    def _prefill_ahead(self, user_id: str) -> None:
        """After a write: the user's new prompt state computed on the batcher's idle thread when no query waits (the
        write's acknowledgement never waits for it; the history is read then, so a burst of writes costs one)."""
        servicer, batcher = self.servicer, self.batcher
        if servicer is None or batcher is None:
            return
        batcher.offer_idle(lambda: self.recommender.prefill_ahead(servicer._stored_history(user_id)))

    def _abort(self) -> None:
        """Releases what a failed start() had opened (the caller owns the store)."""
        self._probe_stop.set()
        if self._server is not None:
            self._server.stop(0)
        if self.batcher is not None:
            self.batcher.close(timeout_s=1.0)
        self.metrics.close()

    # --- history-store health -------------------------------------------------------------------------------

    def report_store(self, ok: bool, detail: str = "") -> None:
        """Records the history store's state (health "recsvc.v1.Recommender/history-store"); logs changes."""
        with self._store_lock:
            if ok == self._store_ok:
                return
            self._store_ok = ok
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            self.health.set(STORE_HEALTH_NAME, status)
        if ok:
            log_event(log, "history_store_available", store=type(self.store).__name__)
        else:
            log_event(log, "history_store_unavailable", logging.WARNING, store=type(self.store).__name__,
                      detail=detail)

    def probe_store(self) -> bool:
        try:
            ok = bool(self.store.ping())
        except Exception as exc:  # a probe never kills the server
            self.report_store(False, repr(exc))
            return False
        self.report_store(ok, "" if ok else "ping failed")
        return ok

    def _probe_loop(self) -> None:
        while not self._probe_stop.wait(self.config.store_probe_s):
            self.probe_store()

    # --- listening ----------------------------------------------------------------------------------------------

    def _listen(self) -> None:
        cfg = self.config
        self.servicer = servicer = RecommenderServicer(
            None,
            self.store,
            None,
            limits=cfg.limits,
            default_mode=cfg.default_mode,
            metrics=self.metrics,
            request_timeout_s=cfg.request_timeout_s,
            on_store_state=self.report_store,
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        interceptors = [ApiKeyInterceptor(cfg.api_key, metrics=self.metrics)] if cfg.api_key else []
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            # a busy port is an error, not a silent second listener, unless --processes N shares it on purpose
            ("grpc.so_reuseport", 1 if cfg.reuse_port else 0),
        ]
        server = grpc.server(
            ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="recsvc-rpc"),
            interceptors=interceptors,
            options=options,
            maximum_concurrent_rpcs=cfg.max_queue + cfg.workers,
        )
        server.add_generic_rpc_handlers([servicer.generic_handler()])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if cfg.reflection:
            enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server
            )
        self.port = self._bind(server)
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(cfg.metrics_port, cfg.metrics_host)
        server.start()
        self._server = server
        log_event(log, "listening", address=self.address, metrics_port=self.metrics_port, health="NOT_SERVING")

    def _bind(self, server: grpc.Server) -> int:
        cfg = self.config
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert:
                return server.add_secure_port(address, server_credentials(cfg.tls_cert, cfg.tls_key))
            return server.add_insecure_port(address)
        except RuntimeError as exc:
            raise UserError(f"cannot listen on {address}: {exc}") from exc

    def _warm_up(self) -> None:
        """One engine call per mode before serving, so the first user request does not pay for lazy init."""
        modes = self.warm(self.recommender)
        log_event(log, "warmed_up", modes=modes)

    def warm(self, recommender: Recommender, histories: list[list[int]] | None = None) -> list[str]:
        """Runs ``recommender`` on the warm-up queries (the default mode and plain; over ``histories`` too, when
        given) and checks it answers each; returns the modes. UserError / RuntimeError when it cannot serve (a
        bundle swap then keeps the serving one)."""
        seed_items = list(recommender.popular_items(2))
        if not seed_items:
            raise UserError("the recommender has an empty catalog")
        k = min(10, recommender.max_k, self.config.limits.max_k)
        modes = list(dict.fromkeys((self.config.default_mode, "plain")))
        for history in [seed_items, *(histories or [])]:
            queries = [RecQuery(history=tuple(history), k=k, mode=mode) for mode in modes]
            results = recommender.recommend(queries)
            if len(results) != len(queries):
                raise RuntimeError(
                    f"warm-up: the engine returned {len(results)} results for {len(queries)} queries"
                )
        return modes

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Drains: NOT_SERVING, refuse new RPCs, let in-flight ones finish for ``grace_s``, then release."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self.health.enter_graceful_shutdown()
            self._probe_stop.set()
            log_event(log, "draining", grace_s=grace_s)
            if self._server is not None:
                self._server.stop(grace_s).wait()
            if self.batcher is not None:
                self.batcher.close(timeout_s=grace_s)
            self.metrics.close()
            if self._owns_store:
                self.store.close()
            self._stopped.set()
            log_event(log, "stopped")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until :meth:`stop` has finished; returns whether it has."""
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> RecServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace_s=1.0)


def serve(
    recommender: Recommender, store: HistoryStore | None = None, config: ServerConfig | None = None
) -> RecServer:
    """Builds and starts a server (``store=None`` -> a fresh in-memory store owned by the server)."""
    return RecServer(recommender, store, config).start()
