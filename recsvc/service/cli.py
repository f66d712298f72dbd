"""``recsvc serve``: runs the gRPC service until SIGTERM/SIGINT, then drains (finish in-flight, grace period).

The engine comes from ``--bundle`` (``recsvc.engine.recommender.BundleRecommender``) or, for a model-free
cold-start service, from ``--popularity counts.json`` (``{"<item_id>": count}``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from recsvc.engine.api import MODES, Recommender
from recsvc.errors import UserError

DEFAULT_PORT = 50051


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the gRPC recommendation service", description=__doc__)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--bundle", help="bundle directory (the model engine)")
    source.add_argument("--popularity", help="JSON {item_id: count}: serve popular items only (no model)")
    p.add_argument("--dtype", default="bf16", help="engine dtype (default: %(default)s)")
    p.add_argument("--redis-url", help="history store (default: in-process, lost on restart)")
    p.add_argument("--redis-ttl-s", type=int, default=90 * 24 * 3600, help="history TTL in Redis")
    p.add_argument("--redis-prefix", default="recsvc:hist:", help="Redis key prefix (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="listen port, 0 = any (default: %(default)s)"
    )
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="metrics listen address")
    p.add_argument("--max-batch", type=int, default=16, help="queries per engine call (1 = no batching)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits to fill")
    p.add_argument("--default-mode", choices=MODES, default="strict", help="mode for UNSPECIFIED requests")
    p.add_argument("--tls-cert", help="PEM certificate chain (enables TLS, with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--api-key", help="require metadata x-api-key (default: $RECSVC_API_KEY; unset = none)")
    p.add_argument("--max-k", type=int, default=50, help="largest k accepted")
    p.add_argument("--max-history", type=int, default=200, help="longest history accepted / stored")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20, help="largest request message")
    p.add_argument("--workers", type=int, default=64, help="RPC handler threads")
    p.add_argument("--grace-s", type=float, default=10.0, help="drain period on SIGTERM")
    p.add_argument("--log-level", default="INFO", help="log level (JSON lines on stderr)")
    p.add_argument("--attention", choices=["fp32", "exact"], default="fp32",
                   help="engine attention: fp32 (fast) or exact (bit-identical to transformers generate)")
    p.add_argument("--drafter", dest="drafter_name", default=None,
                   help="drafter to speculate with: a name under BUNDLE/drafters/ (`recsvc train drafter "
                        "--out-name NAME`) or a model directory (default: BUNDLE/drafter)")
    p.add_argument("--spec", default="auto",
                   help="speculation settings: 'auto' (measure (N, gamma) per K at start-up), or N:gamma")
    p.set_defaults(func=run_serve)


def load_recommender(args: argparse.Namespace) -> Recommender:
    if args.popularity and args.drafter_name:
        raise UserError("--drafter needs --bundle (a popularity service has no model to speculate with)")
    if args.popularity:
        from .popularity import PopularityRecommender

        return PopularityRecommender.from_json(
            args.popularity, max_k=args.max_k, max_history=args.max_history
        )
    try:
        from recsvc.engine.recommender import BundleRecommender
    except ImportError as exc:
        raise UserError(f"the model engine is not available (recsvc.engine.recommender): {exc}") from exc
    rec = BundleRecommender.from_bundle(args.bundle, dtype=args.dtype, attention=args.attention,
                                        drafter_name=args.drafter_name)
    configure_speculation(rec, args.spec, args.bundle)
    return rec


def calibration_histories(rec, bundle: str | None, n: int = 8, max_len: int = 50) -> tuple[list[list[int]], str]:
    """Histories to time speculation on: ``n`` validation users of the bundle's recorded data (seeded sample;
    their last ``max_len`` items), the traffic the target and drafter were trained for; when that data is not
    readable here, short lists of popular items. Returns (histories, where they came from)."""
    if bundle is not None:
        from recsvc.model.bundle import Bundle

        try:
            from training.data.dataset import load_split_dir
            from training.evaluate import sample_users

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


def configure_speculation(rec, spec: str, bundle: str | None = None) -> None:
    """'auto': time strict speculation per K on calibration histories (``calibration_histories``) and keep the
    fastest (N, gamma) or plain; 'N:gamma': fixed."""
    from dataclasses import replace

    if spec == "auto":
        histories, source = calibration_histories(rec, bundle)
        choice = rec.autotune(histories)
        print(f"speculation autotuned per K on {source}: {choice}", flush=True)
        return
    n, _, gamma = spec.partition(":")
    if not (n.isdigit() and gamma.isdigit() and int(n) >= 1 and 1 <= int(gamma) <= 5):
        raise UserError(f"--spec takes 'auto' or N:gamma (N >= 1, gamma 1..5), got {spec!r}")
    rec.spec = replace(rec.spec, draft_beams=int(n), gamma=int(gamma))


def run_serve(args: argparse.Namespace) -> int:
    from .logs import configure_json_logging, log_event
    from .security import api_key_from
    from .server import RecServer, ServerConfig
    from .stores import open_store
    from .validation import Limits

    configure_json_logging(args.log_level.upper())
    log = logging.getLogger("recsvc.service.cli")
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
    )
    config.check()
    recommender = load_recommender(args)
    store_options = {"ttl_s": args.redis_ttl_s, "prefix": args.redis_prefix} if args.redis_url else {}
    store = open_store(args.redis_url, max_len=args.max_history, **store_options)
    if args.redis_url and not store.ping():
        log_event(log, "history_store_unreachable", logging.WARNING, url=args.redis_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    server = RecServer(recommender, store, config)
    try:
        server.start()
        while not stop.wait(0.5):
            pass
        log_event(log, "signal_received", grace_s=args.grace_s)
        server.stop(grace_s=args.grace_s)
    finally:
        server.stop(grace_s=0)
        store.close()
    return 0
