"""``recsvc serve``: runs the gRPC service until SIGTERM/SIGINT, then drains (finish in-flight, grace period).

The engine comes from ``--bundle`` (``recsvc.recommender.bundle_recommender.BundleRecommender``) or, for a model-free
cold-start service, from ``--popularity counts.json`` (``{"<item_id>": count}``).

Start-up: the port listens first with health NOT_SERVING; each step is logged (loading the bundle, loading the
models, calibration per K with its choice, serving); --spec auto calibration is bounded by --startup-budget-s
(the K values not tuned in time are served with plain decoding, logged); then health turns SERVING.
"""

# This module is the command (its flags and dispatch); arg_types.py parses flag values, startup/process.py runs one
# serving process, startup/calibration.py tunes --spec auto, startup/workers.py supervises --processes N.

from __future__ import annotations

import argparse

from .arg_types import LOG_LEVELS, log_level, non_negative_int, port_number, positive_float, positive_int, redis_url

DEFAULT_PORT = 50051


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
    p.add_argument("--catalog-max-mb", type=positive_float, default=None,
                   help="size limit of the live-catalog file in MB (10^6 bytes): a larger file is rejected "
                        "unread (default: $RECSVC_CATALOG_MAX_MB, else 64)")
    p.add_argument("--bundle-watch-s", type=float, default=1.0,
                   help="follow --bundle (e.g. a symlink `current` -> a version directory): when it points to "
                        "another version, or on SIGHUP, load that version beside the serving one, carry the live "
                        "catalog over, warm it and swap it in; a version that fails keeps the old one serving "
                        "(deploy/README.md, \"A new model without downtime\"). Seconds between looks; 0: off "
                        "(default: %(default)s)")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain period on SIGTERM")
    p.add_argument("--log-level", type=log_level, default="INFO",
                   help=f"log level, one of {', '.join(LOG_LEVELS)} (JSON lines on stderr)")
    from recsvc.service.startup.settings import add_engine_args

    add_engine_args(p)  # --dtype, --beam-width, --spec, --default-mode, ...: recsvc.service.startup.settings
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from recsvc.service.startup.process import serve_one, store_options

    store_options(args)  # bad --redis-* combinations fail before anything starts
    if getattr(args, "processes", 1) > 1:
        from recsvc.service.startup.workers import run_workers

        return run_workers(args)
    return serve_one(args)
