"""``recsvc bench processes``: throughput of ``recsvc serve --processes N`` end to end, for several N.

For each N of ``--processes`` (e.g. 1,2) it starts ``recsvc serve --bundle B --processes N`` as a child process
(all N workers serving, then health SERVING), drives it from this process for ``--warmup`` + ``--duration``
seconds with ``--concurrency`` threads, each on its own connection (SO_REUSEPORT spreads connections over the
workers), sending inline-history Recommend requests of the bundle's test users (prebuilt messages, blocking
unary calls, no retries), and stops it (SIGTERM: the workers drain). Reported per N over the measured window:
requests/s, p50/p95/p99 latency, errors by code, each worker's answered requests, CPU seconds and mean batch
(from its /metrics on --metrics-port + i), the server's and this load generator's CPU per request, and how busy
the host's CPUs were; then the throughput of each N relative to the first. Exit status 1 when a run saw an
error, a worker served nothing in the window, or the server did not exit cleanly.

Timings are meaningful only on an otherwise idle host: ``host_cpu_busy`` and ``loadavg_before`` show
whether it was.

The engine flags (``--beam-width``, ``--spec``, ``--dtype``, ``--default-mode``, ...) are ``recsvc serve``'s own
(``recsvc.service.startup.settings``): they resolve to the ``ServeSettings`` whose ``argv()`` the server is started
with, and the report records them (``serving``) beside the precision each run's server resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from recsvc.data.split import EVAL_SPLITS
from recsvc.errors import UserError
from recsvc.service.startup.settings import ServeSettings, add_engine_args

from .processes_load import drive, open_channels, percentile, window
from .processes_server import ServeProcess, WorkerSample

MAX_HISTORY = 200  # recsvc serve's default --max-history: longer histories keep their last items
MAX_K = 50  # recsvc serve's default --max-k


def _ints(lo: int, hi: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < lo or max(values) > hi or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"distinct values in {lo}..{hi} expected, got {text!r}")
        return values

    return parse


def _number(cast, lo: float, hi: float, strict_lo: bool = False):
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value > lo if strict_lo else value >= lo) or value > hi:
            raise argparse.ArgumentTypeError(f"must lie in {'(' if strict_lo else '['}{lo}, {hi}], got {text}")
        return value

    return parse

# one line of `recsvc bench --help`
HELP = ("recsvc serve --processes N as a subprocess under load, per N: req/s, latency, per-worker requests, CPU; "
        "the N=2 vs N=1 ratio")


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--bundle", required=True, help="bundle directory (served; its test users are the requests)")
    p.add_argument("--processes", type=_ints(1, 64), default=[1, 2],
                   help="serving processes to compare, e.g. 1,2 (default: 1,2)")
    p.add_argument("--concurrency", type=_number(int, 1, 1024), default=16,
                   help="client threads = connections, each with one request in flight (default: %(default)s)")
    p.add_argument("--duration", type=_number(float, 0, 3600, strict_lo=True), default=60.0,
                   help="measured seconds per N (default: %(default)s)")
    p.add_argument("--no-balance", dest="balance", action="store_false",
                   help="keep the connections where the kernel places them (default: a connection that would give "
                        "a worker more than its share of the C connections is replaced, so each worker gets C/N)")
    p.add_argument("--warmup", type=_number(float, 0, 600), default=5.0,
                   help="seconds of load before the measured window (default: %(default)s)")
    p.add_argument("--k", type=_number(int, 1, MAX_K), default=10, help="top-k per request (default: %(default)s)")
    p.add_argument("--threads", type=_number(int, 1, 256), default=None,
                   help="the server's --threads, torch threads per worker (default: serve's: 1 per worker when N > "
                        "1, else torch's default)")
    p.add_argument("--max-batch", type=_number(int, 1, 1024), default=16,
                   help="the server's --max-batch (default: %(default)s, serve's)")
    p.add_argument("--max-wait-ms", type=_number(float, 0, 1000), default=5.0,
                   help="the server's --max-wait-ms (default: %(default)s, serve's)")
    p.add_argument("--users", type=int, default=1000, help="test users sampled for requests (default: %(default)s)")
    p.add_argument("--split", choices=EVAL_SPLITS, default="test", help="users of this split")
    p.add_argument("--startup-timeout-s", type=_number(float, 1, 3600), default=600.0,
                   help="longest wait for all workers to serve (--spec auto calibrates; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="user sample seed")
    p.add_argument("--json", dest="json_path", help="write the report here")
    # the server's engine flags, with serve's defaults; --spec off also sends the requests in mode plain
    add_engine_args(p)


def serve_args(args: argparse.Namespace, settings: ServeSettings) -> list[str]:
    """The serving options passed through to ``recsvc serve``: the engine's (``settings.argv()``) and the
    server's."""
    out = [*settings.argv(), "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms),
           "--log-level", "INFO"]
    if args.threads is not None:
        out += ["--threads", str(args.threads)]
    return out


def build_requests(bundle: str, users: int, k: int, spec: str, split: str = "test", seed: int = 0) -> list:
    """One Recommend request per sampled user of ``split`` (the sample of ``recsvc eval``: seeded, sorted by
    user id), its history inline (the last MAX_HISTORY items)."""
    from recsvc.bundle.directory import Bundle
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.service.gen import recommender_pb2 as pb

    if not Path(bundle, "bundle.json").is_file():
        raise UserError(f"not a bundle (no bundle.json): {bundle}")
    everyone = sample_users(load_split_dir(Bundle.open(bundle).resolve_data_dir()).eval_users(split), users, seed)
    mode = pb.PLAIN if spec == "off" else pb.UNSPECIFIED
    requests = [pb.RecommendRequest(user_id=f"bench-{split}-{u.user_id}", history=u.history[-MAX_HISTORY:], k=k,
                                    mode=mode) for u in everyone if u.history]
    if not requests:
        raise UserError(f"no {split} users with a history in the bundle's data")
    return requests


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through measure(): the server is stopped on the way out


def run(args: argparse.Namespace) -> dict:
    if args.users < 1:
        raise UserError("--users must be >= 1")
    from recsvc.service.observability.logs import configure_json_logging

    configure_json_logging("ERROR")
    requests = build_requests(args.bundle, args.users, args.k, args.spec, args.split, args.seed)
    settings = ServeSettings.from_args(args)
    options = serve_args(args, settings)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        rows = [measure(args.bundle, n, options, requests, args.concurrency, args.warmup, args.duration,
                        args.startup_timeout_s, args.balance) for n in args.processes]
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    report = {
        "bench": "processes",
        "bundle": str(args.bundle),
        "host": {"cpus": len(os.sched_getaffinity(0)), "cpu_model": _cpu_model()},
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "k": args.k,
        "spec": args.spec,
        "request_mode": "plain" if args.spec == "off" else f"default (the server's --default-mode, "
                                                           f"{settings.default_mode})",
        "users": len(requests),
        "balanced_connections": args.balance,
        "serving": settings.describe(),
        "serve_args": options,
        "rows": rows,
        "throughput_ratio": {f"{r['processes']}/{rows[0]['processes']}":
                             round(r["throughput_rps"] / rows[0]["throughput_rps"], 3)
                             if rows[0]["throughput_rps"] else None for r in rows[1:]},
    }
    report["verified"] = all(r["errors"] == {} and r["workers_served"] == r["processes"]
                             and r["exit_code"] == 0 for r in rows)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(markdown_table(report))
    if not report["verified"]:
        print("error: a run saw errors, a worker that served nothing, or a server that did not exit cleanly")
        raise SystemExit(1)
    return report


def measure(bundle: str, processes: int, serve_options: list[str], requests: list, concurrency: int,
            warmup_s: float, duration_s: float, startup_timeout_s: float, balance: bool = True) -> dict:
    """One N: start the server, load it, sample counters around the measured window, stop it."""
    with tempfile.TemporaryDirectory(prefix="recsvc-bench-processes-") as tmp:
        server = ServeProcess(bundle, processes, serve_options, Path(tmp) / "serve.log")
        with server:
            serving = server.start(startup_timeout_s)
            loadavg = [round(x, 2) for x in os.getloadavg()]
            marks: dict[str, float] = {}
            samples: dict[str, list[WorkerSample | None]] = {}
            cpu: dict[str, tuple[float, tuple[int, int]]] = {}

            def measured_window() -> None:
                time.sleep(warmup_s)
                for name, pause in (("start", duration_s), ("end", 0.0)):
                    marks[name] = time.perf_counter()
                    cpu[name] = (time.process_time(), _host_cpu())
                    samples[name] = server.sample()
                    time.sleep(pause)

            channels, placement = open_channels(server.target, concurrency, processes,
                                                lambda ch: _placed_on(server, ch, requests[0]), balance)
            try:
                logs = drive(channels, requests, measured_window)
            finally:
                for ch in channels:
                    ch.close()
            stopped = server.stop()
        elapsed = marks["end"] - marks["start"]
        latencies, codes = window(logs, marks["start"], marks["end"])
        ok = codes.get("OK", 0)
        workers = _workers(serving, samples["start"], samples["end"])
        server_cpu = sum(w["cpu_s"] for w in workers if w["cpu_s"] is not None)
        client_cpu = cpu["end"][0] - cpu["start"][0]
        (busy0, total0), (busy1, total1) = cpu["start"][1], cpu["end"][1]
        return {
            "processes": processes,
            "threads_per_worker": [w["torch_threads"] for w in workers],
            "startup_s": server.startup_s,
            "loadavg_before": loadavg,
            "requests": sum(codes.values()),
            "ok": ok,
            "window_s": round(elapsed, 3),
            "throughput_rps": round(ok / elapsed, 2),
            "mean_ms": round(sum(latencies) / len(latencies), 3) if latencies else None,
            "p50_ms": percentile(latencies, 50),
            "p95_ms": percentile(latencies, 95),
            "p99_ms": percentile(latencies, 99),
            "errors": {code: n for code, n in sorted(codes.items()) if code != "OK"},
            "connections_per_worker": [placement.count(i) for i in range(processes)],
            "workers": workers,
            "workers_served": sum(1 for w in workers if (w["ok"] or 0) > 0),
            "server_cpu_s": round(server_cpu, 3),
            "server_cpu_ms_per_request": round(1000 * server_cpu / ok, 3) if ok else None,
            "client_cpu_s": round(client_cpu, 3),
            "client_cpu_ms_per_request": round(1000 * client_cpu / ok, 3) if ok else None,
            "host_cpu_busy": round((busy1 - busy0) / (total1 - total0), 3) if total1 > total0 else None,
            "speculation_per_width": serving[0].get("speculation_per_width"),
            "precision": serving[0].get("precision"),
            "beam_width": serving[0].get("beam_width"),
            **stopped,
        }


def _placed_on(server: ServeProcess, channel, request) -> int:
    """The worker that answers on ``channel``: the one whose Recommend count grows by a probe call."""
    from recsvc.service.gen import recommender_pb2_grpc as pb_grpc

    def answered() -> list[float]:
        return [sum((s.ok, *s.errors.values())) if s else float("nan") for s in server.sample()]

    before = answered()
    pb_grpc.RecommenderStub(channel).Recommend(request, timeout=60.0)
    grew = [i for i, (b, a) in enumerate(zip(before, answered(), strict=True)) if a > b]
    if len(grew) != 1:
        raise RuntimeError(f"cannot tell which worker answered a probe call (metrics: {before})")
    return grew[0]


def _workers(serving: list[dict], before: list[WorkerSample | None], after: list[WorkerSample | None]) -> list:
    """Per worker over the measured window: Recommend answered OK / with errors, CPU seconds, mean batch."""
    out = []
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        entry = serving[i] if i < len(serving) else {}
        row: dict = {"worker": entry.get("worker", i), "pid": entry.get("pid"),
                     "torch_threads": entry.get("torch_threads"), "ok": None, "errors": None, "cpu_s": None,
                     "mean_batch_size": None}
        if a is not None and b is not None:
            batches = a.batches - b.batches
            row.update(ok=int(a.ok - b.ok), cpu_s=round(a.cpu_s - b.cpu_s, 3),
                       errors={c: int(n - b.errors.get(c, 0)) for c, n in a.errors.items() if n > b.errors.get(c, 0)},
                       mean_batch_size=round((a.batched_queries - b.batched_queries) / batches, 2) if batches else None)
        out.append(row)
    return out


def _host_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat; idle and iowait are not busy)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return (0, 0)
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return (total - fields[3] - fields[4], total)


def _cpu_model() -> str:
    from recsvc.hardware import cpu_model

    return cpu_model()


def markdown_table(report: dict) -> str:
    lines = ["| processes | threads/worker | req/s | p50 ms | p95 ms | p99 ms | OK per worker | server CPU ms/req | "
             "client CPU ms/req | host CPU busy | errors |",
             "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in report["rows"]:
        errors = ", ".join(f"{c}: {n}" for c, n in r["errors"].items()) or "-"
        per_worker = " / ".join(str(w["ok"]) for w in r["workers"])
        threads = ",".join(str(t) for t in r["threads_per_worker"])
        lines.append(f"| {r['processes']} | {threads} | {r['throughput_rps']:.1f} | {r['p50_ms']} | {r['p95_ms']} | "
                     f"{r['p99_ms']} | {per_worker} | {r['server_cpu_ms_per_request']} | "
                     f"{r['client_cpu_ms_per_request']} | {r['host_cpu_busy']} | {errors} |")
    ratios = ", ".join(f"{key}: {value}x" for key, value in report["throughput_ratio"].items())
    if ratios:
        lines.append(f"\nthroughput ratio: {ratios} (concurrency {report['concurrency']}, "
                     f"{report['duration_s']} s, k={report['k']}, spec {report['spec']}, "
                     f"{report['host']['cpus']} CPUs)")
    return "\n".join(lines)
