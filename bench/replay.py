"""`recsvc bench replay`: a split's test period replayed against a real ``recsvc serve`` and a real redis-server.

The trace: every sampled user's history before the period (train + valid items) is written first (untimed
setup), then each of the user's test interactions, in order, is preceded by R Recommend calls (the user's
stored history, k items, plain decoding) and followed by its RecordInteractions. A user's events run in
order on one client thread at a time; ``--concurrency`` threads take users from a shared queue.

Per configuration (``--cache``: lean = the previous engine forward without the user-state cache (today's
server), off = the fast forward without it (``--state-cache-mb 0``), on = ``--state-cache-mb`` MB, ahead = on +
``--prefill-ahead``: the user's prefill after each write, when the engine is idle; compiled = on with
``--forward compiled``, its start-up compiling the forward before the trace) and concurrency level, a
fresh redis-server and ``recsvc serve`` subprocess: Recommend latency p50 / p99, throughput (requests of both
kinds per second, Recommend per second), the state cache's hit rate (full and partial hits per Recommend, from
the server's /metrics) and the server's resident memory at the end. JSON output (``--json``).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path

from recsvc.data.split import EVAL_SPLITS
from recsvc.errors import UserError

# one line of `recsvc bench --help`
HELP = ("a split's test period replayed against recsvc serve + redis-server (R Recommend calls before each "
        "RecordInteractions): p50 / p99, throughput, state-cache hit rate, RSS")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True)
    p.add_argument("--users", type=int, default=100, help="test users replayed (seeded sample)")
    p.add_argument("--r", type=int, default=3, help="Recommend calls before each test interaction")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--concurrency", default="1,16", help="client threads, comma-separated levels")
    p.add_argument("--cache", default="lean,off,on,ahead",
                   help="configurations, comma-separated: lean (the previous forward, no user-state cache: today's "
                        "server), off (the fast forward, no cache), on, ahead (on + --prefill-ahead), compiled "
                        "(on + --forward compiled)")
    p.add_argument("--state-cache-mb", type=int, default=256, help="its budget when on")
    p.add_argument("--max-seconds", type=float, default=None, help="stop a run's trace after this long")
    p.add_argument("--split", choices=EVAL_SPLITS, default="test")
    p.add_argument("--dtype", default="fp32", help="the server's engine dtype (the state cache needs fp32)")
    p.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `recsvc serve` flag (repeatable)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")


def build_trace(bundle: str, users: int, r: int, split: str = "test", seed: int = 0
                ) -> list[tuple[str, list[int], list[int]]]:
    """Per user: (user id, history before the period, the period's interactions in order)."""
    from recsvc.bundle.directory import Bundle
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir

    if r < 0:
        raise UserError(f"--r must be >= 0, got {r}")
    if not Path(bundle, "bundle.json").is_file():
        raise UserError(f"not a bundle (no bundle.json): {bundle}")
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    sampled = sample_users(data.eval_users(split), users, seed)
    trace = [(f"replay-{split}-{u.user_id}", list(u.history), list(u.targets)) for u in sampled if u.targets]
    if not trace:
        raise UserError(f"no {split} users with interactions in the period")
    return trace


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def replay(target: str, trace: list[tuple[str, list[int], list[int]]], r: int, k: int, concurrency: int,
           max_seconds: float | None = None) -> dict:
    """Runs the trace against ``target`` (histories already written); latencies and counts."""
    import grpc

    from recsvc.client.client import RecClient

    users: queue.Queue = queue.Queue()
    for item in trace:
        users.put(item)
    lat: list[float] = []
    errors: dict[str, int] = {}
    counts = {"recommend": 0, "record": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + max_seconds if max_seconds else None

    def worker() -> None:
        with RecClient(target, timeout_s=60.0) as client:
            while True:
                try:
                    user, _, events = users.get_nowait()
                except queue.Empty:
                    return
                for item in events:
                    if deadline is not None and time.monotonic() > deadline:
                        return
                    for _ in range(r):
                        start = time.perf_counter()
                        try:
                            client.recommend(user, k=k, mode="plain")
                            ms = 1000.0 * (time.perf_counter() - start)
                            with lock:
                                lat.append(ms)
                                counts["recommend"] += 1
                        except grpc.RpcError as exc:
                            with lock:
                                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    try:
                        client.record(user, [item])
                        with lock:
                            counts["record"] += 1
                    except grpc.RpcError as exc:
                        with lock:
                            errors[exc.code().name] = errors.get(exc.code().name, 0) + 1

    began = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    return {"seconds": round(seconds, 3), "recommend": counts["recommend"], "record": counts["record"],
            "errors": errors, "p50_ms": _percentile(lat, 0.5), "p99_ms": _percentile(lat, 0.99),
            "mean_ms": statistics.mean(lat) if lat else None,
            "requests_per_s": (counts["recommend"] + counts["record"]) / seconds if seconds else None,
            "recommend_per_s": counts["recommend"] / seconds if seconds else None}


def _metrics(port: int) -> dict[str, float]:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = sample.value
    return out


def run_one(args: argparse.Namespace, trace, config: str, concurrency: int, workdir: Path) -> dict:
    from bench.processes_server import ServeProcess
    from harness.redis_server import RedisProcess
    from recsvc.client.client import RecClient

    cache_mb = 0 if config in ("off", "lean") else args.state_cache_mb
    name = f"{config}-{concurrency}"
    (workdir / f"redis-{name}").mkdir(parents=True, exist_ok=True)
    redis = RedisProcess(data_dir=workdir / f"redis-{name}")
    redis.start()
    serve_args = ["--redis-url", redis.url, "--state-cache-mb", str(cache_mb), "--max-batch", str(args.max_batch),
                  "--spec", "off", "--dtype", args.dtype, "--log-level", "INFO", *args.serve_arg]
    if config == "ahead":
        serve_args.append("--prefill-ahead")
    if config == "compiled":
        serve_args += ["--forward", "compiled"]
    if config == "lean":
        serve_args += ["--forward", "lean"]
    if args.threads is not None:
        serve_args += ["--threads", str(args.threads)]
    server = ServeProcess(args.bundle, 1, serve_args, workdir / f"serve-{name}.log")
    try:
        server.start(args.startup_timeout_s)
        with RecClient(server.target, timeout_s=30.0) as client:
            for user, history, _ in trace:  # the period's starting state (untimed)
                if history:
                    client.record(user, history)
        before = _metrics(server.metrics_port)
        result = replay(server.target, trace, args.r, args.k, concurrency, args.max_seconds)
        after = _metrics(server.metrics_port)
    finally:
        stopped = server.stop()
        redis.close()
    delta = {name: after.get(f"recsvc_state_cache_{name}_total", 0.0) - before.get(f"recsvc_state_cache_{name}_total",
                                                                                    0.0)
             for name in ("hits", "partial_hits", "misses", "evictions")}
    looked = sum(delta[n] for n in ("hits", "partial_hits", "misses"))
    return {"cache": config, "state_cache_mb": cache_mb, "concurrency": concurrency, **result,
            "hit_rate": delta["hits"] / looked if looked else 0.0,
            "partial_hit_rate": delta["partial_hits"] / looked if looked else 0.0,
            "evictions": delta["evictions"], "state_cache_bytes": after.get("recsvc_state_cache_bytes", 0.0),
            "rss_mb": after.get("process_resident_memory_bytes", 0.0) / 2**20, "server_exit": stopped}


def run(args: argparse.Namespace) -> dict:
    from recsvc.hardware import machine
    from recsvc.report.records import markdown_table, write_json

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise UserError(f"--concurrency takes positive integers, got {args.concurrency!r}")
    configs = [c.strip() for c in str(args.cache).split(",") if c.strip()]
    if not configs or set(configs) - {"lean", "off", "on", "ahead", "compiled"}:
        raise UserError(f"--cache takes lean, off, on, ahead, compiled (comma-separated), got {args.cache!r}")
    if args.state_cache_mb < 1 and set(configs) - {"off", "lean"}:
        raise UserError("--state-cache-mb must be >= 1 with the cache on")
    trace = build_trace(args.bundle, args.users, args.r, args.split, args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="recsvc-replay-") as tmp:
        for concurrency in levels:
            for config in configs:
                row = run_one(args, trace, config, concurrency, Path(tmp))
                rows.append(row)
                print(f"cache {row['cache']}, concurrency {concurrency}: p50 {row['p50_ms']} ms, p99 "
                      f"{row['p99_ms']} ms, {row['requests_per_s']:.1f} req/s, hit rate {row['hit_rate']:.2f} "
                      f"(+{row['partial_hit_rate']:.2f} partial), RSS {row['rss_mb']:.0f} MB", flush=True)
    payload = {"bench": "replay", "bundle": str(args.bundle), "users": len(trace), "r": args.r, "k": args.k,
               "split": args.split, "events": sum(len(e) for _, _, e in trace), "machine": machine(),
               "dtype": args.dtype, "rows": rows}
    print(markdown_table(rows, [("cache", "cache"), ("concurrency", "conc."), ("p50_ms", "p50 ms"),
                                ("p99_ms", "p99 ms"), ("requests_per_s", "req/s"), ("hit_rate", "hit rate"),
                                ("partial_hit_rate", "partial"), ("rss_mb", "RSS MB")]))
    write_json(args.json_path, payload)
    return payload
