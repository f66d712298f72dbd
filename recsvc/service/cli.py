"""``recsvc serve``: runs the gRPC service until SIGTERM/SIGINT, then drains (finish in-flight, grace period).

The engine comes from ``--bundle`` (``recsvc.engine.recommender.BundleRecommender``) or, for a model-free
cold-start service, from ``--popularity counts.json`` (``{"<item_id>": count}``).

Start-up: the port listens first with health NOT_SERVING; each step is logged (loading the bundle, loading the
models, calibration per K with its choice, serving); --spec auto calibration is bounded by --startup-budget-s
(the K values not tuned in time are served with plain decoding, logged); then health turns SERVING.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from recsvc.engine.api import Recommender
from recsvc.errors import UserError

DEFAULT_PORT = 50051
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
REDIS_SCHEMES = ("redis", "rediss", "unix")
CALIBRATION_KS = (1, 5, 10, 20)
log = logging.getLogger(__name__)


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
    from .stores.redis_urls import is_cluster_url, parse_cluster_url

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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the gRPC recommendation service", description=__doc__)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--bundle", help="bundle directory (the model engine)")
    source.add_argument("--popularity", help="JSON {item_id: count}: serve popular items only (no model)")
    p.add_argument("--redis-url", type=redis_url,
                   help="history store: redis://host:port/db, or a Redis Cluster redis+cluster://host:port[,host:port"
                        "...] (default: in-process, lost on restart)")
    p.add_argument("--redis-ttl-s", type=positive_int, default=90 * 24 * 3600,
                   help="history TTL in Redis, seconds >= 1")
    p.add_argument("--redis-prefix", default="recsvc:hist:",
                   help="Redis key prefix; a cluster key is PREFIX{user_id} (default: %(default)s)")
    p.add_argument("--redis-wait-replicas", type=non_negative_int, default=0,
                   help="acknowledge a RecordInteractions only once this many replicas of the key's master have "
                        "it (Redis WAIT; fewer in time -> UNAVAILABLE); 0 = off (default: %(default)s)")
    p.add_argument("--redis-wait-timeout-ms", type=positive_int, default=500,
                   help="longest WAIT for --redis-wait-replicas, milliseconds >= 1 (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help="listen port 0..65535, 0 = any (default: %(default)s)"
    )
    p.add_argument("--metrics-port", type=port_number, help="Prometheus /metrics port 0..65535 (default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="metrics listen address")
    p.add_argument("--max-batch", type=int, default=16, help="queries per engine call (1 = no batching)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits to fill")
    p.add_argument("--tls-cert", help="PEM certificate chain (enables TLS, with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--api-key", help="require metadata x-api-key (default: $RECSVC_API_KEY; unset = none)")
    p.add_argument("--max-k", type=int, default=50, help="largest k accepted")
    p.add_argument("--max-history", type=int, default=200, help="longest history accepted / stored")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20, help="largest request message")
    p.add_argument("--workers", type=int, default=64, help="RPC handler threads")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads of each serving process (default: 1 per worker with --processes "
                        "> 1, so N workers use N cores; else torch's default: the cores, or $OMP_NUM_THREADS)")
    p.add_argument("--processes", type=positive_int, default=1,
                   help="serving processes sharing --port through SO_REUSEPORT, each with its own engine and "
                        "gRPC server (N > 1 needs an explicit --port; worker i serves metrics on "
                        "--metrics-port + i; log lines carry \"worker\": i; default: %(default)s)")
    p.add_argument("--catalog", default=None,
                   help="live-catalog file of added / retired items (`recsvc catalog add|retire`), re-read while "
                        "serving whenever it changes (default: BUNDLE/catalog_live.json; docs/CATALOG.md)")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain period on SIGTERM")
    p.add_argument("--log-level", type=log_level, default="INFO",
                   help=f"log level, one of {', '.join(LOG_LEVELS)} (JSON lines on stderr)")
    from .settings import add_engine_args

    add_engine_args(p)  # --dtype, --beam-width, --spec, --default-mode, ...: recsvc.service.settings
    p.set_defaults(func=run_serve)


Step = Callable[..., None]


def _log_step(event: str, level: int = logging.INFO, **fields) -> None:
    from .logs import log_event

    log_event(log, event, level, **fields)


def load_recommender(
    args: argparse.Namespace, *, step: Step | None = None, should_stop: Callable[[], bool] | None = None
) -> Recommender:
    """The engine of ``args`` (``--bundle``: ``recsvc.service.settings.build_recommender`` of its
    ``ServeSettings``; or ``--popularity``), loaded and (``--spec``) configured; each step is reported through
    ``step(event, level=INFO, **fields)`` (default: the JSON log)."""
    step = step or _log_step
    if args.popularity and args.drafter_name:
        raise UserError("--drafter needs --bundle (a popularity service has no model to speculate with)")
    if args.popularity and getattr(args, "attributes", None):
        raise UserError("--attributes needs --bundle (rules are decoded by the model engine)")
    if args.popularity and getattr(args, "catalog", None):
        raise UserError("--catalog needs --bundle (a popularity service has no catalog trie to extend)")
    if args.popularity and args.exclude_history:
        raise UserError("--exclude-history needs --bundle (requests may still ask for it: exclude_history)")
    if args.popularity:
        from .popularity import PopularityRecommender

        step("loading_popularity", popularity=args.popularity)
        return PopularityRecommender.from_json(
            args.popularity, max_k=args.max_k, max_history=args.max_history
        )
    from .settings import ServeSettings, build_recommender

    step("loading_bundle", bundle=args.bundle)
    return build_recommender(ServeSettings.from_args(args), step=step, should_stop=should_stop)


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def calibration_histories(rec, bundle: str | None, n: int = 8, max_len: int = 50) -> tuple[list[list[int]], str]:
    """Histories to time speculation on: ``n`` validation users of the bundle's recorded data (seeded sample;
    their last ``max_len`` items), the traffic the target and drafter were trained for; when that data is not
    readable here, short lists of popular items. Returns (histories, where they came from)."""
    if bundle is not None:
        from recsvc.model.bundle import Bundle

        try:
            from recsvc.data.sampling import sample_users
            from recsvc.data.split import load_split_dir

            data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
            users = sample_users(data.eval_users("valid"), n, seed=1)
            known = [[i for i in u.history[-max_len:] if rec.known_item(i)] for u in users]
            known = [h for h in known if h]
            if known:
                return known, f"{len(known)} validation users"
        except (UserError, OSError, ImportError):
            pass
    popular = rec.popular_items(40)
    return [popular[i : i + 5 + i % 7] for i in range(0, 3 * n, 3)], "popular items"


class _OutOfBudget(Exception):
    """The start-up budget would be exceeded by the next calibration run."""


def configure_speculation(rec, spec: str, bundle: str | None = None, *, budget_s: float = 60.0,
                          step: Step | None = None, should_stop: Callable[[], bool] | None = None,
                          ks: tuple[int, ...] = CALIBRATION_KS,
                          cache_settings: dict | None = None) -> dict[int, tuple[int, int]]:
    """'auto': time strict speculation per K on calibration histories (``calibration_histories``) and keep the
    fastest (N, gamma) or plain, within ``budget_s`` seconds: a calibration run that would end after the budget
    is not started and the K values not tuned by then are served with plain decoding (logged). 'N:gamma':
    fixed. 'off': plain decoding for every K (no calibration). Returns the per-K choice ({} when fixed, off or
    without a drafter); (0, 0) = plain decoding.

    ``cache_settings`` (the serving settings the timing depends on): reuse the choice stored in
    BUNDLE/calibration.json when it was made on this hardware with these models and settings, and store a
    complete calibration there (``recsvc.service.calibration_cache``); None: always calibrate."""
    from dataclasses import replace

    step = step or _log_step
    if spec == "auto":
        if getattr(rec, "drafter", None) is None:
            step("calibration_skipped", reason="no drafter: plain decoding")
            return {}
        key = None
        if cache_settings is not None and bundle is not None:
            from .calibration_cache import calibration_key, load_choice

            key = calibration_key(bundle, {**cache_settings, "ks": list(ks)})
            stored = load_choice(bundle, key)
            if stored is not None and set(stored) == set(ks):
                rec.spec = replace(rec.spec, per_k=stored)
                step("calibration_reused", file=os.path.join(bundle, "calibration.json"),
                     choice={str(k): "plain" if v[0] == 0 else f"N={v[0]} gamma={v[1]}" for k, v in stored.items()})
                return stored
        from recsvc.engine.api import RecQuery
        from recsvc.engine.autotune import autotune

        histories, source = calibration_histories(rec, bundle)
        deadline = time.monotonic() + budget_s
        longest = 0.0  # the longest calibration run so far: a run is started only if it can end in time

        def run(k: int, n: int, gamma: int) -> float:
            nonlocal longest
            if (should_stop is not None and should_stop()) or time.monotonic() + longest > deadline:
                raise _OutOfBudget
            rec.spec = replace(rec.spec, per_k={k: (n, gamma)})
            began = time.perf_counter()
            rec.recommend([RecQuery(history=h, k=k, mode="strict") for h in histories])
            took = time.perf_counter() - began
            longest = max(longest, took)
            return took

        step("calibrating", ks=list(ks), histories=source, budget_s=budget_s)
        choice: dict[int, tuple[int, int]] = {}
        why_plain: dict[int, str] = {}  # K served plainly for another reason than calibration's choice
        complete = True
        for i, k in enumerate(ks):
            began = time.monotonic()
            try:
                choice.update(autotune(run, [k]))
            except _OutOfBudget:
                untuned = list(ks[i:])
                choice.update(dict.fromkeys(untuned, (0, 0)))
                why_plain = dict.fromkeys(untuned, f"not calibrated within --startup-budget-s {budget_s:g}")
                step("calibration_budget_exhausted", logging.WARNING, budget_s=budget_s, untuned_ks=untuned,
                     serving="plain decoding for these K")
                complete = False
                break
            n, gamma = choice[k]
            step("calibrated", k=k, choice="plain" if n == 0 else f"N={n} gamma={gamma}",
                 seconds=round(time.monotonic() - began, 3))
        rec.spec = replace(rec.spec, per_k=choice, why_plain=why_plain or None)
        print(f"speculation autotuned per K on {source}: {choice}", flush=True)
        if key is not None and complete:
            from .calibration_cache import save_choice

            if not save_choice(bundle, key, choice):
                step("calibration_not_stored", reason=f"{bundle} is not writable: the next start calibrates again")
        return choice
    if spec == "off":  # the K=1 choice applies to every larger K
        rec.spec = replace(rec.spec, per_k={1: (0, 0)}, why_plain={1: "speculation off (--spec off)"})
        step("speculation_off", serving="plain decoding for every K")
        return {}
    n, _, gamma = spec.partition(":")
    if not (n.isdigit() and gamma.isdigit() and int(n) >= 1 and 1 <= int(gamma) <= 5):
        raise UserError(f"--spec takes 'auto', 'off' or N:gamma (N >= 1, gamma 1..5), got {spec!r}")
    rec.spec = replace(rec.spec, draft_beams=int(n), gamma=int(gamma))
    step("speculation_fixed", draft_beams=int(n), gamma=int(gamma))
    return {}


def _serving_fields(args: argparse.Namespace, rec: Recommender) -> dict:
    """What the "serving" log line says about the engine: bundle or popularity table, decoding settings."""
    if args.popularity:
        return {"popularity": args.popularity, "decoding": "popularity"}
    from .settings import engine_fields

    return {
        "bundle": args.bundle,
        "dtype": args.dtype,
        "attention": args.attention,
        "drafter": args.drafter_name or ("default" if getattr(rec, "drafter", None) is not None else None),
        "spec": args.spec,
        "exclude_history": args.exclude_history,
        "rules_strategy": args.rules_strategy,
        "torch_threads": torch_threads(),
        **engine_fields(rec),  # precision, beam_width, speculation_per_k, prior_weight, drafter_loaded
    }


def _redacted(url: str) -> str:
    from .stores.redis_urls import redacted

    return redacted(url)


def store_options(args: argparse.Namespace) -> dict:
    """``open_store`` options from the --redis-* flags; UserError for settings that cannot work together."""
    from .stores.redis_urls import is_cluster_url

    if not args.redis_url:
        if args.redis_wait_replicas:
            raise UserError("--redis-wait-replicas needs --redis-url (the in-process store has no replicas)")
        return {}
    if is_cluster_url(args.redis_url) and ("{" in args.redis_prefix or "}" in args.redis_prefix):
        raise UserError(f"--redis-prefix cannot contain '{{' or '}}' with a Redis Cluster (the user id is the "
                        f"hash tag), got {args.redis_prefix!r}")
    return {"ttl_s": args.redis_ttl_s, "prefix": args.redis_prefix, "wait_replicas": args.redis_wait_replicas,
            "wait_timeout_ms": args.redis_wait_timeout_ms}


def run_serve(args: argparse.Namespace) -> int:
    store_options(args)  # bad --redis-* combinations fail before anything starts
    if getattr(args, "processes", 1) > 1:
        return run_workers(args)
    return _serve_one(args)


def _worker_main(args: argparse.Namespace, index: int) -> None:
    """A ``--processes N`` worker (spawned: a fresh interpreter, no inherited grpc or torch state)."""
    args.processes = 1
    args.worker_index = index
    if getattr(args, "threads", None) is None:
        args.threads = 1  # N workers on N cores: one intra-op thread each, no oversubscription
    parent = os.getppid()

    def watch_parent() -> None:  # the parent killed (SIGKILL, OOM): drain and exit rather than linger
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, name="recsvc-parent-watch", daemon=True).start()
    if args.metrics_port:
        args.metrics_port += index
    try:
        _serve_one(args)
    except UserError as exc:
        print(f"error: worker {index}: {exc}", file=sys.stderr, flush=True)
        os._exit(2)


def run_workers(args: argparse.Namespace) -> int:
    """``--processes N``: the pattern of grpc's examples/python/multiprocessing. The parent binds nothing (it
    only checks that the port is free), spawns N workers, each with its own engine and gRPC server listening on
    the same port with SO_REUSEPORT (the kernel spreads connections over them), forwards SIGTERM / SIGINT to
    them (each drains as a single-process server does) and exits when all have exited: 0 when every worker
    exited with 0, else 1 (a worker that fails stops the others). A worker whose parent dies drains and exits."""
    import multiprocessing
    import socket

    from .logs import configure_json_logging, log_event
    from .settings import check_beam_width

    n = args.processes
    if args.port == 0:
        raise UserError(f"--processes {n} needs an explicit --port (the workers share it; 0 would give each "
                        "worker a different port)")
    if args.metrics_port is not None and args.metrics_port != 0 and args.metrics_port + n - 1 > 65535:
        raise UserError(f"--metrics-port {args.metrics_port} + {n - 1} workers exceeds 65535")
    if args.beam_width is not None:
        check_beam_width(args.beam_width)
    configure_json_logging(args.log_level.upper(), role="parent", pid=os.getpid())
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # no SO_REUSEPORT: fails if anything listens
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for index in range(n):
        proc = ctx.Process(target=_worker_main, args=(args, index), name=f"recsvc-worker-{index}")
        proc.start()
        workers.append(proc)
    log_event(log, "workers_started", processes=n, port=args.port, pids=[w.pid for w in workers],
              metrics_ports=None if args.metrics_port is None
              else [args.metrics_port + i if args.metrics_port else 0 for i in range(n)])
    signalled = False
    while any(w.is_alive() for w in workers):
        failed = [i for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
        if (stop.is_set() or failed) and not signalled:
            if failed:
                log_event(log, "worker_failed", logging.ERROR, workers=failed,
                          exitcodes=[workers[i].exitcode for i in failed])
            log_event(log, "stopping_workers", reason="signal" if stop.is_set() else "worker_failed")
            for w in workers:
                if w.is_alive():
                    os.kill(w.pid, signal.SIGTERM)
            signalled = True
        time.sleep(0.1)
    for w in workers:
        w.join()
    codes = [w.exitcode for w in workers]
    log_event(log, "workers_exited", exitcodes=codes)
    return 0 if all(code == 0 for code in codes) else 1


def _serve_one(args: argparse.Namespace) -> int:
    from .logs import configure_json_logging, log_event
    from .security import api_key_from
    from .server import RecServer, ServerConfig
    from .settings import check_beam_width
    from .stores import open_store
    from .validation import Limits

    if args.beam_width is not None:  # fail before anything starts
        check_beam_width(args.beam_width)
    worker = getattr(args, "worker_index", None)
    configure_json_logging(args.log_level.upper(), **({} if worker is None else {"worker": worker,
                                                                               "pid": os.getpid()}))
    config = ServerConfig(
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        default_mode=args.default_mode,
        limits=Limits(max_k=args.max_k, max_history=args.max_history, max_record_items=args.max_history),
        max_message_bytes=args.max_message_bytes,
        api_key=api_key_from(args.api_key),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        workers=args.workers,
        reuse_port=worker is not None,
    )
    config.check()
    if args.bundle and getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    started = time.monotonic()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    store = open_store(args.redis_url, max_len=args.max_history, **store_options(args))
    server = RecServer(None, store, config)  # listens with health NOT_SERVING until attach()
    watch = None
    try:
        server.start()
        if args.redis_url and not store.ping():
            log_event(log, "history_store_unreachable", logging.WARNING, url=_redacted(args.redis_url))
        recommender = load_recommender(args, should_stop=stop.is_set)
        if args.bundle and not stop.is_set():  # the live catalog: added / retired items, re-read on change
            from recsvc.model.live_catalog import CATALOG_FILE

            from .catalog_watch import watch_catalog

            recommender, watch = watch_catalog(recommender, args.catalog or os.path.join(args.bundle, CATALOG_FILE),
                                               server.metrics.registry)
        if not stop.is_set():
            server.attach(recommender, startup_s=round(time.monotonic() - started, 3),
                          grace_s=args.grace_s, **_serving_fields(args, recommender))
            while not stop.wait(0.2):
                pass
        log_event(log, "signal_received", grace_s=args.grace_s)
        server.stop(grace_s=args.grace_s)
    finally:
        server.stop(grace_s=0)
        if watch is not None:
            watch.close()
        store.close()
    # Everything the server owned is released and drained: skip the interpreter's teardown of torch and
    # transformers (1-2 s on a loaded host), so the process exits promptly after draining.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
