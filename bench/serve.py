"""``recsvc bench serve``: load test of the gRPC service (throughput, latency percentiles, errors by code).

Runs an in-process server around a recommender (a bundle, a popularity table, or any ``Recommender``) or
targets a running server, and drives it with N client threads for ``duration`` seconds per concurrency level.
Compares batching on/off (max batch 16 vs 1) and speculation on/off (mode strict vs plain). ``--outage``
stops and restarts a private redis-server (``--redis-url spawn``) in the middle of the run, reports errors
by code before/during/after the outage and checks that every acknowledged RecordInteractions is in the
final history. Client threads share the process (and the GIL) with an in-process server, so absolute
numbers are pessimistic; use ``--target`` against ``recsvc serve`` for deployment figures.

``--bundle`` is served as ``recsvc serve --bundle`` serves it: the same engine flags (``--beam-width``,
``--spec``, ``--dtype``, ... with serve's defaults) resolve to the same ``ServeSettings`` and the same
constructor builds the recommender (``recsvc.service.startup.settings``), --spec auto calibration included. The
report records those settings and what the engine resolved (``serving``: beam width, default mode, speculation
policy and per-K choice, precision), and each row counts the modes the server reported using (``modes_used``).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from recsvc.service.startup.settings import ServeSettings, add_engine_args, build_recommender, engine_fields

BATCH_ON, BATCH_OFF = 16, 1
SPEC_ON, SPEC_OFF = "strict", "plain"


# --- CLI -------------------------------------------------------------------------------------------------


# one line of `recsvc bench --help`
HELP = "load test of the gRPC service: throughput, latency percentiles"
# --batching / --speculation: measured with it on, off, or both (None)
SWITCH: dict[str, bool | None] = {"on": True, "off": False, "both": None}


def add_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--bundle", help="serve this bundle in-process")
    source.add_argument("--popularity", help="serve a popularity table {item_id: count} in-process")
    source.add_argument("--target", help="host:port of a running server")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], help="client threads, e.g. 1,4,16")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per concurrency level")
    p.add_argument("--redis-url", help="store of the in-process server; 'spawn' = a private redis-server")
    p.add_argument("--batching", choices=tuple(SWITCH), default="both", help="max batch 16 vs 1")
    p.add_argument("--speculation", choices=tuple(SWITCH), default="both", help="strict vs plain")
    p.add_argument("--outage", action="store_true", help="stop/restart the spawned Redis mid-run")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--users", type=int, default=256, help="distinct users (each gets a stored history)")
    p.add_argument("--history-len", type=int, default=20, help="stored history length per user")
    p.add_argument("--api-key", help="for --target servers that require one")
    p.add_argument("--tls-ca", help="for --target servers with TLS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the results here")
    add_engine_args(p)  # --bundle's engine, as `recsvc serve` builds it (--beam-width, --spec, --dtype, ...)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return values


def _switch(value: str) -> bool | None:
    return SWITCH[value]


def run(args: argparse.Namespace) -> None:
    """The command; exits with status 1 when the outage drill finds a lost acknowledged write."""
    from recsvc.service.observability.logs import configure_json_logging

    configure_json_logging("ERROR")
    if args.popularity:
        from recsvc.service.startup.popularity import PopularityRecommender

        source: Any = PopularityRecommender.from_json(args.popularity)
        settings = None
    elif args.bundle:
        settings = ServeSettings.from_args(args)
        source = build_recommender(settings)
    else:
        source, settings = args.target, None
    report = run_serve_bench(
        source,
        args.concurrency,
        args.duration,
        args.redis_url,
        _switch(args.batching),
        _switch(args.speculation),
        args.json_path,
        k=args.k,
        users=args.users,
        history_len=args.history_len,
        outage=args.outage,
        api_key=args.api_key,
        tls_ca=args.tls_ca,
        seed=args.seed,
        settings=settings,
    )
    if report.get("outage") and not report["outage"]["verified"]:
        print("error: acknowledged RecordInteractions are missing from the final history")
        raise SystemExit(1)


# --- measurement -----------------------------------------------------------------------------------------


@dataclass
class _Tally:
    latencies_ms: list[float] = field(default_factory=list)
    codes: Counter = field(default_factory=Counter)
    batch_sizes: list[int] = field(default_factory=list)
    target_calls: int = 0
    accepted_steps: int = 0
    modes: Counter = field(default_factory=Counter)  # Stats.mode names: what the server reported doing
    beam_widths: Counter = field(default_factory=Counter)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100.0 * len(sorted_values) + 0.5) - 1))
    return float(sorted_values[index])


def _row(
    config: str, max_batch: int | None, mode: str, concurrency: int, tally: _Tally, elapsed: float
) -> dict:
    lat = sorted(tally.latencies_ms)
    ok = tally.codes.get("OK", 0)
    return {
        "config": config,
        "max_batch": max_batch,
        "mode": mode,
        "concurrency": concurrency,
        "requests": sum(tally.codes.values()),
        "ok": ok,
        "throughput_rps": round(ok / elapsed, 2) if elapsed > 0 else 0.0,
        "p50_ms": round(_percentile(lat, 50), 3),
        "p95_ms": round(_percentile(lat, 95), 3),
        "p99_ms": round(_percentile(lat, 99), 3),
        "errors": {code: n for code, n in sorted(tally.codes.items()) if code != "OK"},
        "mean_batch_size": round(sum(tally.batch_sizes) / len(tally.batch_sizes), 2)
        if tally.batch_sizes
        else 0.0,
        "target_calls_per_request": round(tally.target_calls / ok, 3) if ok else 0.0,
        "accepted_steps_per_request": round(tally.accepted_steps / ok, 3) if ok else 0.0,
        "modes_used": dict(sorted(tally.modes.items())),
        "beam_widths": {str(w): n for w, n in sorted(tally.beam_widths.items())},
    }


def _load_level(
    target: str,
    client_kwargs: dict,
    users: list[str],
    concurrency: int,
    duration: float,
    k: int,
    mode: str,
    seed: int,
) -> tuple[_Tally, float]:
    """``concurrency`` threads send stored-history Recommends for ``duration`` seconds."""
    import grpc

    from recsvc.client.client import RecClient
    from recsvc.service.gen import recommender_pb2 as pb

    tallies = [_Tally() for _ in range(concurrency)]
    start_barrier = threading.Barrier(concurrency + 1)
    stop = threading.Event()

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        tally = tallies[i]
        with RecClient(target, **client_kwargs) as client:
            start_barrier.wait()
            while not stop.is_set():
                began = time.perf_counter()
                try:
                    reply = client.recommend(rng.choice(users), k=k, mode=mode, exclude_history=True)
                except grpc.RpcError as exc:
                    tally.codes[exc.code().name] += 1
                    continue
                tally.latencies_ms.append((time.perf_counter() - began) * 1000.0)
                tally.codes["OK"] += 1
                tally.batch_sizes.append(reply.stats.batch_size)
                tally.target_calls += reply.stats.target_forward_calls
                tally.accepted_steps += reply.stats.accepted_steps
                tally.modes[pb.DecodingMode.Name(reply.stats.mode)] += 1
                tally.beam_widths[reply.stats.beam_width] += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    start_barrier.wait()
    began = time.perf_counter()
    stop.wait(duration)
    stop.set()
    for t in threads:
        t.join(60)
    elapsed = time.perf_counter() - began
    merged = _Tally()
    for t in tallies:
        merged.latencies_ms += t.latencies_ms
        merged.codes.update(t.codes)
        merged.batch_sizes += t.batch_sizes
        merged.target_calls += t.target_calls
        merged.accepted_steps += t.accepted_steps
        merged.modes.update(t.modes)
        merged.beam_widths.update(t.beam_widths)
    return merged, elapsed


def _item_pool(source: Any, target: str | None, client_kwargs: dict) -> list[int]:
    if target is None:
        return list(source.popular_items(1000))
    from recsvc.client.client import RecClient

    with RecClient(target, **client_kwargs) as client:  # a user without history gets the popular items
        reply = client.recommend(f"bench-cold-{random.getrandbits(48):x}", k=20)
    return [item.item_id for item in reply.items]


def _seed_histories(
    target: str, client_kwargs: dict, users: list[str], pool: list[int], n: int, seed: int
) -> None:
    from recsvc.client.client import RecClient

    rng = random.Random(seed)
    with RecClient(target, **client_kwargs) as client:
        for user in users:
            if not client.history(user):
                client.record(user, [rng.choice(pool) for _ in range(n)])


# --- entry point -----------------------------------------------------------------------------------------


def run_serve_bench(
    target_or_bundle: Any,
    concurrency: list[int],
    duration: float,
    redis_url: str | None = None,
    batching: bool | None = None,
    speculation: bool | None = None,
    json_path: str | Path | None = None,
    *,
    k: int = 10,
    users: int = 256,
    history_len: int = 20,
    outage: bool = False,
    api_key: str | None = None,
    tls_ca: str | Path | None = None,
    seed: int = 0,
    print_table: bool = True,
    settings: ServeSettings | None = None,
) -> dict:
    """Runs the load test; returns (and optionally writes as JSON) ``{"rows": [...], "outage": {...}|None,
    "serving": {...}}``.

    ``target_or_bundle``: a ``Recommender`` object (served in-process on a free port), a bundle directory
    (built as ``recsvc serve`` builds it: ``settings``, default ``ServeSettings.for_bundle``), or ``host:port``
    of a running server. ``settings``: what a Recommender object was built from (recorded; its default mode is
    the in-process server's). ``batching`` / ``speculation``: True, False, or None for both.
    ``redis_url``: None (in-memory store), a URL, or ``"spawn"`` (a private redis-server; needed by
    ``outage``).
    """
    from harness.redis_server import RedisProcess
    from recsvc.service.rpc.server import RecServer, ServerConfig
    from recsvc.service.stores import open_store

    if isinstance(target_or_bundle, (str, Path)) and Path(target_or_bundle).is_dir():
        settings = settings or ServeSettings.for_bundle(str(target_or_bundle))
        target_or_bundle = build_recommender(settings)
    remote = target_or_bundle if isinstance(target_or_bundle, str) else None
    if remote and (outage or redis_url):
        raise UserError("--outage and --redis-url need an in-process server (--bundle or --popularity)")
    if outage and redis_url != "spawn":
        raise UserError("--outage needs --redis-url spawn (the bench must own the redis-server it stops)")
    if duration <= 0 or not concurrency:
        raise UserError("duration must be > 0 and at least one concurrency level given")
    client_kwargs = {"api_key": api_key, "tls_ca": tls_ca, "timeout_s": 30.0}
    redis_proc = RedisProcess().start() if redis_url == "spawn" else None
    store_url = redis_proc.url if redis_proc else redis_url
    store = None if remote else open_store(store_url, max_len=1000)
    user_ids = [f"bench-user-{i}" for i in range(users)]
    batch_choices = (
        [None]
        if remote
        else ([BATCH_ON, BATCH_OFF] if batching is None else [BATCH_ON if batching else BATCH_OFF])
    )
    mode_choices = [SPEC_ON, SPEC_OFF] if speculation is None else [SPEC_ON if speculation else SPEC_OFF]
    rows: list[dict] = []
    outage_report = None
    try:
        pool = _item_pool(target_or_bundle, remote, client_kwargs)
        for max_batch in batch_choices:
            server = None
            if not remote:
                config = ServerConfig(
                    port=0,
                    max_batch=max_batch,
                    max_wait_ms=5.0 if max_batch > 1 else 0.0,
                    limits=_limits(target_or_bundle, k),
                    **({"default_mode": settings.default_mode} if settings is not None else {}),
                )
                server = RecServer(target_or_bundle, store, config).start()
            target = remote or server.address
            try:
                _seed_histories(target, client_kwargs, user_ids, pool, history_len, seed)
                for mode in mode_choices:
                    for level in concurrency:
                        tally, elapsed = _load_level(
                            target, client_kwargs, user_ids, level, duration, k, mode, seed
                        )
                        label = f"{'server' if max_batch is None else f'batch{max_batch}'}/{mode}"
                        rows.append(_row(label, max_batch, mode, level, tally, elapsed))
                if outage and max_batch == batch_choices[0]:
                    outage_report = _run_outage(
                        target, client_kwargs, redis_proc, pool, max(concurrency), duration, seed
                    )
            finally:
                if server is not None:
                    server.stop(grace_s=2.0)
    finally:
        if store is not None:
            store.close()
        if redis_proc is not None:
            redis_proc.close()
    serving = ({"target": remote} if remote else
               {**(settings.describe() if settings is not None else {}), **engine_fields(target_or_bundle)})
    from recsvc.hardware import machine

    report = {"duration_s": duration, "k": k, "users": users, "serving": serving, "rows": rows,
              "outage": outage_report, "machine": None if remote else machine()}  # a remote server's: unknown
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if print_table:
        print(markdown_table(rows))
        if outage_report:
            print(markdown_outage(outage_report))
    return report


def _limits(recommender: Any, k: int):
    from recsvc.service.rpc.validation import Limits

    if not 1 <= k <= recommender.max_k:
        raise UserError(f"k must be between 1 and {recommender.max_k} (got {k})")
    return Limits(max_k=recommender.max_k, max_history=200)


# --- outage drill ----------------------------------------------------------------------------------------


def _run_outage(
    target: str,
    client_kwargs: dict,
    redis_proc: Any,
    pool: list[int],
    threads: int,
    duration: float,
    seed: int,
) -> dict:
    """Thirds of ``duration``: before, Redis down (from the moment it has exited), after restart. Threads own
    their users (ordered acks). A call is counted in the phase it started in; a Recommend retried across the
    restart can end OK. ``write_during_outage``: the code of one RecordInteractions sent once Redis has exited."""
    import grpc

    from recsvc.client.client import RecClient

    phase = ["before"]
    codes: dict[str, Counter] = {"before": Counter(), "during": Counter(), "after": Counter()}
    acked: dict[str, list[int]] = {}
    lock = threading.Lock()
    stop = threading.Event()
    restarted_at: list[float] = []
    first_ok_after: list[float] = []
    call_kwargs = {**client_kwargs, "timeout_s": 5.0}

    def worker(i: int) -> None:
        rng = random.Random(seed * 7919 + i)
        mine = [f"outage-{i}-{j}" for j in range(4)]
        with RecClient(target, **call_kwargs) as client:
            while not stop.is_set():
                user, current = rng.choice(mine), phase[0]
                op = rng.random()
                try:
                    if op < 0.4:
                        item = rng.choice(pool)
                        client.record(user, [item])
                        with lock:
                            acked.setdefault(user, []).append(item)
                    elif op < 0.7:
                        client.recommend(user, k=5)  # stored history
                        if current == "after" and not first_ok_after:
                            first_ok_after.append(time.monotonic())
                    else:
                        client.recommend(user, history=rng.sample(pool, 3), k=5)  # inline history
                    name = "OK"
                except grpc.RpcError as exc:
                    name = exc.code().name
                with lock:
                    codes[current][name] += 1
                time.sleep(0.002)

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    third = duration / 3.0
    time.sleep(third)
    redis_proc.stop()  # calls still in flight as it flushes and exits count as "before"
    phase[0] = "during"
    started = time.monotonic()
    probe = _probe_write(target, call_kwargs, pool[0], acked, lock)  # one write, known to start in the outage
    time.sleep(max(0.0, third - (time.monotonic() - started)))
    # the outage lasts at least until one worker call made in it has answered (bounded): on a busy machine the
    # calls in flight when Redis stopped can take the whole third, leaving the phase without a measurement
    deadline = time.monotonic() + max(5.0, third)
    while time.monotonic() < deadline:
        with lock:
            if sum(codes["during"].values()) > 0:
                break
        time.sleep(0.01)
    redis_proc.start()
    restarted_at.append(time.monotonic())
    phase[0] = "after"
    time.sleep(third)
    stop.set()
    for w in workers:
        w.join(30)
    lost = 0
    with RecClient(target, **client_kwargs) as client:
        for user, items in acked.items():
            if not _is_subsequence(items, client.history(user)):
                lost += 1
    acknowledged = sum(len(items) for items in acked.values())
    recovery = round(first_ok_after[0] - restarted_at[0], 3) if first_ok_after else None
    return {
        "phases": {name: dict(sorted(counter.items())) for name, counter in codes.items()},
        "acknowledged_records": acknowledged,
        "users_with_lost_records": lost,
        "verified": lost == 0,
        "recovery_s": recovery,
        "write_during_outage": probe,
    }


def _probe_write(target: str, client_kwargs: dict, item: int, acked: dict[str, list[int]], lock: Any) -> str:
    """One RecordInteractions while Redis is down: its status code name (an acknowledged one is verified too)."""
    import grpc

    from recsvc.client.client import RecClient

    with RecClient(target, **client_kwargs) as client:
        try:
            client.record("outage-probe", [item])
        except grpc.RpcError as exc:
            return exc.code().name
    with lock:
        acked.setdefault("outage-probe", []).append(item)
    return "OK"


def _is_subsequence(needle: Sequence[int], haystack: Sequence[int]) -> bool:
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


# --- reporting -------------------------------------------------------------------------------------------


def markdown_table(rows: list[dict]) -> str:
    head = "| config | conc. | req/s | p50 ms | p95 ms | p99 ms | mean batch | target calls/req | errors |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        errors = ", ".join(f"{code}: {n}" for code, n in r["errors"].items()) or "-"
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['throughput_rps']:.1f} | {r['p50_ms']:.2f} | "
            f"{r['p95_ms']:.2f} | {r['p99_ms']:.2f} | {r['mean_batch_size']:.2f} | "
            f"{r['target_calls_per_request']:.2f} | {errors} |"
        )
    return "\n".join(lines)


def markdown_outage(report: dict) -> str:
    lines = ["| phase | results by code |", "|---|---|"]
    for name, counts in report["phases"].items():
        lines.append(f"| {name} | {', '.join(f'{c}: {n}' for c, n in counts.items()) or '-'} |")
    verdict = "all present" if report["verified"] else f"LOST for {report['users_with_lost_records']} users"
    lines.append(
        f"\nacknowledged RecordInteractions: {report['acknowledged_records']} ({verdict}); "
        f"recovery after restart: {report['recovery_s']} s; a write once Redis had exited: "
        f"{report['write_during_outage']}"
    )
    return "\n".join(lines)
