"""One ``recsvc serve`` process from start to exit: the port listens first (health NOT_SERVING), the engine is
loaded (``--bundle`` or ``--popularity``) and calibrated (``settings.build_recommender``), the live catalog
watched, then the server is attached (health SERVING) and ``--bundle`` followed (a new version swapped in:
``bundle_watch``) until SIGTERM / SIGINT, and drained."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from recsvc.errors import UserError
from recsvc.recommender.api import Recommender
from recsvc.service.observability.logs import Step, log_step

from .calibration import torch_threads


def load_recommender(
    args: argparse.Namespace, *, step: Step | None = None, should_stop: Callable[[], bool] | None = None
) -> Recommender:
    """The engine of ``args`` (``--bundle``: ``recsvc.service.startup.settings.build_recommender`` of its
    ``ServeSettings``; or ``--popularity``), loaded and (``--spec``) configured; each step is reported through
    ``step(event, level=INFO, **fields)`` (default: the JSON log)."""
    step = step or log_step
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


def serving_fields(args: argparse.Namespace, rec: Recommender) -> dict:
    """What the "serving" log line says about the engine: bundle or popularity table, decoding settings."""
    if args.popularity:
        return {"popularity": args.popularity, "decoding": "popularity"}
    from .settings import engine_fields

    return {
        "bundle": args.bundle,
        "dtype": args.dtype,
        "attention": args.attention,
        "drafter": args.drafter_name or ("default" if rec.facts.drafter_loaded else None),
        "spec": args.spec,
        "exclude_history": rec.exclude_history,  # the flags or the bundle's
        "rules_strategy": args.rules_strategy,
        "torch_threads": torch_threads(),
        **engine_fields(rec),  # precision, beam_width, speculation_per_width, prior_weight, drafter_loaded
    }


def store_options(args: argparse.Namespace) -> dict:
    """``open_store`` options from the --redis-* flags; UserError for settings that cannot work together."""
    from recsvc.service.stores.redis_urls import is_cluster_url

    if not args.redis_url:
        if args.redis_wait_replicas:
            raise UserError("--redis-wait-replicas needs --redis-url (the in-process store has no replicas)")
        return {}
    if is_cluster_url(args.redis_url) and ("{" in args.redis_prefix or "}" in args.redis_prefix):
        raise UserError(f"--redis-prefix cannot contain '{{' or '}}' with a Redis Cluster (the user id is the "
                        f"hash tag), got {args.redis_prefix!r}")
    return {"ttl_s": args.redis_ttl_s, "prefix": args.redis_prefix, "wait_replicas": args.redis_wait_replicas,
            "wait_timeout_ms": args.redis_wait_timeout_ms}


def with_bundle(args: argparse.Namespace, bundle: str) -> argparse.Namespace:
    """``args`` with ``--bundle`` replaced (a version directory); ``args`` is not changed."""
    flags = argparse.Namespace(**vars(args))
    flags.bundle = bundle
    return flags


def watch_bundle(args: argparse.Namespace, serving: str, served, server, catalog, stop: threading.Event):
    """Follows ``--bundle`` (``recsvc.service.swap.bundle_watch``) from ``serving``, the version directory loaded at
    start: a new version is built by the same factory with the same flags, carried the live catalog, warmed by
    the server's warm-up, then swapped in; SIGHUP reloads."""
    from recsvc.service.swap.bundle_watch import BundleWatch

    from .settings import ServeSettings, build_recommender

    def load(version_dir: str):
        return build_recommender(ServeSettings.from_args(with_bundle(args, version_dir)), should_stop=stop.is_set)

    watch = BundleWatch(served, args.bundle, load, server.warm, catalog, check_every_s=args.bundle_watch_s,
                        on_swapped=gc.freeze,  # the new version's objects out of the collector's reach too
                        serving=serving, busy=lambda: served.busy or server.servicer.activity.busy())
    server.metrics.registry.register(watch)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: watch.request_reload())
    return watch.start()


def serve_one(args: argparse.Namespace) -> int:
    """Serves ``args`` in this process until a signal, drains, and exits the process (``os._exit(0)``)."""
    from recsvc.engine.kernels.plan import check_flags
    from recsvc.service.observability.logs import configure_json_logging
    from recsvc.service.rpc.security import api_key_from
    from recsvc.service.rpc.server import RecServer, ServerConfig
    from recsvc.service.rpc.validation import Limits
    from recsvc.service.stores import open_store
    from recsvc.service.stores.redis_urls import redacted

    from .settings import check_beam_width

    if args.beam_width is not None:  # fail before anything starts
        check_beam_width(args.beam_width)
    if args.bundle:  # contradictory forward flags: before anything starts too
        check_flags(args.forward, args.attention)
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
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload before the bundle is followed: start-up loads it anyway
    store = open_store(args.redis_url, max_len=args.max_history, **store_options(args))
    server = RecServer(None, store, config)  # listens with health NOT_SERVING until attach()
    watch = bundle_watch = None
    try:
        server.start()
        if args.redis_url and not store.ping():
            log_step("history_store_unreachable", logging.WARNING, url=redacted(args.redis_url))
        # the version directory --bundle points to now, read from there: a flip of a symlink during the load
        # cannot mix two versions' files (the bundle watch takes it from here)
        version = os.path.realpath(args.bundle) if args.bundle else None
        recommender = load_recommender(with_bundle(args, version) if version else args, should_stop=stop.is_set)
        if args.bundle and not stop.is_set():  # the live catalog: added / retired items, re-read on change
            from recsvc.catalog.file import CATALOG_FILE, MB
            from recsvc.service.swap.catalog_watch import watch_catalog

            max_mb = getattr(args, "catalog_max_mb", None)
            recommender, watch = watch_catalog(recommender, args.catalog or os.path.join(args.bundle, CATALOG_FILE),
                                               server.metrics.registry,
                                               max_bytes=None if max_mb is None else int(max_mb * MB))
        if args.bundle and not stop.is_set():
            from recsvc.recommender.swappable import SwappableRecommender

            recommender = SwappableRecommender(recommender)  # a new bundle version swaps in behind it
        if not stop.is_set():
            # what start-up loaded (models, libraries: about 400k objects) leaves the cyclic collector's reach: a
            # full collection, which any burst of allocations sets off (a live-catalog rebuild), would otherwise
            # stop every thread for the whole heap's scan (0.5-0.6 s measured). Garbage made later is collected
            # as before; only cycles among what is frozen now would never be.
            gc.freeze()
            server.attach(recommender, startup_s=round(time.monotonic() - started, 3),
                          grace_s=args.grace_s, **serving_fields(args, recommender))
            if args.bundle and getattr(args, "bundle_watch_s", 0) > 0:
                bundle_watch = watch_bundle(args, version, recommender, server, watch, stop)
            while not stop.wait(0.2):
                pass
        log_step("signal_received", grace_s=args.grace_s)
        server.stop(grace_s=args.grace_s)
    finally:
        server.stop(grace_s=0)
        if bundle_watch is not None:
            bundle_watch.close()
        if watch is not None:
            watch.close()
        store.close()
    # Everything the server owned is released and drained: skip the interpreter's teardown of torch and
    # transformers (1-2 s on a loaded host), so the process exits promptly after draining.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
