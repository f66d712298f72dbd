"""``recsvc bench catalog``: a large live-catalog file offered to a server under load must not stall serving.

One real gRPC server (in this process) serves the bundle and watches a live-catalog file, checked every
0.5 s as ``recsvc serve`` does; a load process (``bench.catalog_load``: ``--callers`` threads, inline
histories of the bundle's test users, PLAIN) calls it back to back the whole time. The phases, one after
another under that one load:

1. ``baseline``: ``--seconds`` with no file change: the latency p50 / p99 / max of the load without it.
2. ``over_limit``: a ``--items``-item catalog file (``--dim``-d vectors; written as ``recsvc catalog add``
   writes it: validated, then saved by ``LiveCatalog.save``; about 8.4 KB per item with 384 dimensions) is
   moved into place with the server's limit at ``--max-mb`` (default: the product default): it is rejected
   unread, with a reason naming the limit.
3. ``accepted_process``: the limit raised to ``--accept-mb`` and the same catalog (a new version) moved in:
   read and validated in another process (``recsvc.catalog.reader``), then applied.
4. ``accepted_thread`` (``--compare-thread``): the file read in the serving process's watch thread instead,
   as before the reader process existed (other item ids: the state is rebuilt again).

Each offered phase lasts from the file's move until its outcome (applied / rejected, read from the watch's
counters) plus ``--after-s``. Verdict per phase: its slowest call against the baseline p99 + ``--budget-ms``
(200 ms). Prints a table and the JSON document, written to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from recsvc.cli.args import set_threads
from recsvc.errors import UserError
from recsvc.hardware import machine
from recsvc.report.records import markdown_table, write_json
from recsvc_base.progress import print_record

# one line of `recsvc bench --help`
HELP = ("a large live-catalog file offered to a server under load: latency against the same load without it, the "
        "file's outcome and reason")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="bundle directory (its data split gives the histories)")
    p.add_argument("--items", type=int, default=30000, help="items the offered catalog file adds")
    p.add_argument("--dim", type=int, default=384,
                   help="vector length of the added items (MiniLM: 384; a bundle with BUNDLE/fresh: its length)")
    p.add_argument("--callers", type=int, default=4, help="concurrent callers of the load")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the baseline phase")
    p.add_argument("--after-s", type=float, default=3.0, help="load kept on after each outcome")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--users", type=int, default=500, help="test users whose histories the load cycles through")
    p.add_argument("--max-mb", type=float, default=None,
                   help="the server's size limit in the over_limit phase (default: the product default)")
    p.add_argument("--accept-mb", type=float, default=1000.0,
                   help="the limit in the accepted phases (0: skip them)")
    p.add_argument("--compare-thread", action="store_true",
                   help="also offer the file read in the serving process's thread (the stall it replaced)")
    p.add_argument("--budget-ms", type=float, default=200.0, help="allowed excess over the baseline p99")
    p.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for one file's outcome")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the server")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the catalog files are written (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=None, help="JSON report")


def catalog_document(base_ids, n: int, dim: int, seed: int = 0, first_id: int | None = None) -> dict[str, Any]:
    """A live-catalog document adding ``n`` items (ids above the bundle's, free semantic ids, random unit
    vectors rounded as ``recsvc catalog add`` rounds them)."""
    rng = np.random.default_rng(seed)
    levels, size = base_ids.levels, base_ids.codebook_size
    taken = {tuple(r) for r in base_ids.codes.tolist()}
    codes: list[list[int]] = []
    while len(codes) < n:
        for row in rng.integers(0, size, size=(n - len(codes), levels)).tolist():
            if tuple(row) not in taken:
                taken.add(tuple(row))
                codes.append(row)
    vecs = rng.normal(size=(n, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    start = int(base_ids.item_ids.max()) + 1 if first_id is None else first_id
    return {"version": 1, "retire": [],
            "add": [{"item_id": start + i, "codes": codes[i], "vector": [round(float(v), 7) for v in vecs[i]]}
                    for i in range(n)]}


def write_catalog(doc: dict[str, Any], base_ids, path: Path, dim: int | None) -> int:
    """Validates and saves ``doc`` as the catalog commands do; returns the file's size in bytes."""
    from recsvc.catalog.file import parse_catalog

    parse_catalog(doc, base_ids, dim).save(path)
    return path.stat().st_size


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def _stats(calls: list[list[Any]], start: float, end: float) -> dict[str, Any]:
    window = [c for c in calls if start <= c[0] <= end]
    ms = [c[1] for c in window]
    errors = sum(1 for c in window if c[2] != "OK")
    return {"calls": len(window), "errors": errors, "p50_ms": round(_percentile(ms, 50), 2),
            "p99_ms": round(_percentile(ms, 99), 2), "max_ms": round(max(ms), 2) if ms else math.nan,
            "seconds": round(end - start, 2)}


class _PauseMonitor:
    """A thread of the server's process that sleeps 5 ms at a time and records each wake-up later than 50 ms
    (wall-clock time, seconds late): how long the process could not run Python (the GIL held by another thread,
    or no CPU given to the process)."""

    def __init__(self) -> None:
        self.late: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pause-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.time()
        while not self._stop.wait(0.005):
            now = time.time()
            if now - last > 0.05:
                self.late.append((now, now - last))
            last = now

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


class _Load:
    """The load process: started, then stopped with its calls returned."""

    def __init__(self, target: str, callers: int, k: int, histories: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.catalog_load", "--target", target, "--callers", str(callers),
             "--k", str(k), "--histories", str(histories)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            raise UserError("the load process did not start")

    def stop(self) -> list[list[Any]]:
        out, _ = self.proc.communicate("stop\n", timeout=120)
        return json.loads(out.strip().splitlines()[-1])["calls"]


def run(args: argparse.Namespace) -> None:
    from recsvc.bundle.directory import Bundle
    from recsvc.catalog.file import MB, max_catalog_bytes
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.recommender.bundle_recommender import BundleRecommender
    from recsvc.service.rpc.server import RecServer, ServerConfig
    from recsvc.service.swap.catalog_watch import watch_catalog

    if args.items < 1 or args.dim < 1 or args.callers < 1 or args.seconds <= 0:
        raise UserError("--items, --dim, --callers and --seconds must be positive")
    set_threads(args.threads)
    bundle = Bundle.open(args.bundle)
    base_ids = bundle.load_ids()
    rec = BundleRecommender.from_bundle(args.bundle, dtype=args.dtype, use_drafter=False)
    dim = int(rec.fresh.vectors.vectors.shape[1]) if rec.fresh is not None else None
    if dim is not None and dim != args.dim:
        raise UserError(f"the bundle's fresh items have {dim}-d vectors: pass --dim {dim}")
    users = sample_users(load_split_dir(bundle.resolve_data_dir()).eval_users("test"), args.users, seed=0)
    limit = int(args.max_mb * MB) if args.max_mb is not None else max_catalog_bytes()
    accept = int(args.accept_mb * MB)

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        histories = work / "histories.json"
        histories.write_text(json.dumps([u.history[-rec.max_history:] for u in users]))
        print(f"writing the {args.items}-item catalog files ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        doc = catalog_document(base_ids, args.items, args.dim)
        files = {"over_limit": work / "offer-a.json", "accepted_process": work / "offer-b.json"}
        size = write_catalog(doc, base_ids, files["over_limit"], dim)
        shutil.copyfile(files["over_limit"], files["accepted_process"])  # a new file: the watch reads it again
        if args.compare_thread:  # other item ids: applying it rebuilds the state as the process phase did
            shift = int(max(e["item_id"] for e in doc["add"])) + 1 - doc["add"][0]["item_id"]
            doc["add"] = [{**e, "item_id": e["item_id"] + shift} for e in doc["add"]]
            doc["version"] = 3
            files["accepted_thread"] = work / "offer-c.json"
            write_catalog(doc, base_ids, files["accepted_thread"], dim)
        del doc
        write_s = time.perf_counter() - t0
        print(f"catalog file: {size / MB:.1f} MB ({write_s:.0f} s to write them)", file=sys.stderr, flush=True)

        watched = work / "catalog_live.json"
        live, watch = watch_catalog(rec, watched, check_every_s=0.5, max_bytes=limit)
        gc.freeze()  # as `recsvc serve` does before it serves (recsvc.service.startup.process)
        server = RecServer(live, None, ServerConfig(default_mode="plain", max_wait_ms=2.0)).start()
        monitor = _PauseMonitor()
        phases: list[dict[str, Any]] = []
        try:
            load = _Load(server.address, args.callers, args.k, histories)
            try:
                time.sleep(3.0)  # warm-up, not measured
                b0 = time.time()
                time.sleep(args.seconds)
                marks = {"baseline": (b0, time.time(), None)}
                for name, path in files.items():
                    if name != "over_limit" and args.accept_mb <= 0:
                        continue
                    watch.max_bytes = limit if name == "over_limit" else accept
                    watch.isolated = name != "accepted_thread"
                    before = (watch.applied, watch.rejected)
                    moved = time.time()
                    os.replace(path, watched)
                    while (watch.applied, watch.rejected) == before:
                        if time.time() - moved > args.timeout_s:
                            raise UserError(f"no outcome for the {name} file within {args.timeout_s:g} s")
                        time.sleep(0.02)
                    decided = time.time()
                    outcome = "applied" if watch.applied > before[0] else "rejected"
                    time.sleep(args.after_s)
                    timing = watch.last_timing if outcome == "applied" else None
                    marks[name] = (moved, time.time(), {"outcome": outcome,
                                                        "seconds_to_outcome": round(decided - moved, 2),
                                                        "timing": timing,
                                                        "limit_mb": watch.max_bytes / MB,
                                                        "read_in": "another process" if watch.isolated
                                                        else "the serving process's thread",
                                                        "reason": watch.last_reason if outcome == "rejected"
                                                        else None})
            finally:
                calls = load.stop()
        finally:
            monitor.close()
            watch.close()
            server.stop(grace_s=0.5)
    base = _stats(calls, *marks["baseline"][:2])
    for name, (start, end, info) in marks.items():
        info = dict(info or {})
        timing = info.pop("timing", None)
        row = {"phase": name, **_stats(calls, start, end), **info}
        if name != "baseline":
            row["max_over_baseline_p99_ms"] = round(row["max_ms"] - base["p99_ms"], 2)
            row["within_budget"] = bool(row["max_over_baseline_p99_ms"] <= args.budget_ms)
            if timing is not None:  # where the slow calls fell: while the file was read, or the state built
                row["read_s"], row["build_s"] = round(timing[1] - timing[0], 2), round(timing[2] - timing[1], 2)
                slow = base["p99_ms"] + args.budget_ms
                for part, (lo, hi) in (("read", timing[:2]), ("build", timing[1:])):
                    # a call overlaps the part when it was still waiting at its start or ended inside it
                    row[f"max_ms_during_{part}"] = round(max(
                        (c[1] for c in calls if c[0] >= lo and c[0] - c[1] / 1000.0 <= hi), default=0.0), 2)
                row["calls_over_budget"] = sum(1 for c in calls if start <= c[0] <= end and c[1] > slow)
        # the slowest calls (s after the phase began, when they ended; ms) and the server process's longest
        # pause (s after the phase began, when it ended; s)
        window = sorted((c for c in calls if start <= c[0] <= end), key=lambda c: -c[1])[:5]
        row["slowest_calls"] = [[round(c[0] - start, 2), round(c[1], 1)] for c in window]
        pauses = [p for p in monitor.late if start <= p[0] <= end]
        top = max(pauses, key=lambda p: p[1], default=None)
        row["server_longest_pause_s"] = None if top is None else [round(top[0] - start, 2), round(top[1], 3)]
        phases.append(row)
    report = {"bench": "catalog", "bundle": str(args.bundle), "machine": machine(), "precision": rec.facts.precision,
              "threads": args.threads, "callers": args.callers, "k": args.k, "items": args.items,
              "dim": args.dim, "file_mb": round(size / MB, 1), "default_limit_mb": max_catalog_bytes() / MB,
              "budget_ms": args.budget_ms, "phases": phases,
              # the product's phases (the in-thread read is the comparison, not the product)
              "met": all(p.get("within_budget", True) for p in phases if p["phase"] != "accepted_thread")}
    columns = [("phase", "phase"), ("calls", "calls"), ("errors", "errors"), ("p50_ms", "p50 ms"),
               ("p99_ms", "p99 ms"), ("max_ms", "max ms"), ("outcome", "outcome"),
               ("seconds_to_outcome", "s to outcome"), ("read_s", "read s"), ("build_s", "build s"),
               ("server_longest_pause_s", "server pause [at s, s]"),
               ("max_over_baseline_p99_ms", "max - base p99 ms"), ("within_budget", "within budget")]
    print(markdown_table([{k: p.get(k, "") for k, _ in columns} for p in phases], columns))
    for p in phases:
        if p.get("reason"):
            print(f"{p['phase']}: {p['reason']}")
    print_record(report)
    write_json(args.out, report)
