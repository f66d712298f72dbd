"""``recsvc bench swap --bundle B``: the latency of serving while a new bundle version swaps in.

Copies bundle ``B`` into two version directories (``versions/a``, ``versions/b``: the same files, so the loader
does the same work as for a retrained target), starts ``recsvc serve --bundle current --bundle-watch-s 0.2`` on
loopback (the process's own history store, ``--threads 1``), records each caller's history, then drives it with
``--callers`` threads, each with one Recommend in flight at all times (plain mode, k=5, the stored history), and
flips ``current`` between the two versions ``--swaps`` times. For each swap it reports, as
tests/test_bundle_swap.py measures them: the p99 of the calls that ended in the ``--before-s`` seconds before the
flip, the p99 of the calls that began between the flip and 0.5 s after ``bundle_swapped``, their ratio, and the
swap's phases from the server's log (load, warm-up, total) and the server's resident memory after it (a retired
version must be freed: it stays flat over swaps). The summary line gives the ratios' min / median /
max and the failed calls (exit status 1 when a call failed or a swap did not happen).

Same-run ratios only: the absolute latencies depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.processes import stop as stop_process
from harness.serve_log import ServeLog
from recsvc.bundle.directory import Bundle
from recsvc.client.client import RecClient
from recsvc.errors import UserError

# one line of `recsvc bench --help`
HELP = "p99 of serving during a bundle swap against before it, under load (several swaps)"
K = 5
AFTER_SWAP_S = 0.5  # calls that begin this long after bundle_swapped still count as "during" (as the test)


@dataclass
class Calls:
    """Every finished call as (began, seconds), and the failures (appended by the caller threads)."""

    done: list[tuple[float, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def flip(root: Path, version: Path) -> float:
    """Points ``root/current`` at ``version`` atomically (ln -sfn + mv -T); returns when."""
    tmp = root / "current.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(version, tmp)
    os.replace(tmp, root / "current")
    return time.monotonic()


def caller(address: str, user: str, calls: Calls, stop: threading.Event) -> None:
    with RecClient(address, timeout_s=30) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                client.recommend(user, k=K, mode="plain")
            except Exception as exc:  # noqa: BLE001 (counted and reported)
                with calls.lock:
                    calls.failed.append(f"{type(exc).__name__}: {exc}")
                continue
            with calls.lock:
                calls.done.append((began, time.monotonic() - began))


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def start_server(root: Path, serve_args: list[str]) -> ServeLog:
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--bundle", str(root / "current"), "--port", "0",
           "--threads", "1", "--bundle-watch-s", "0.2", "--grace-s", "1", "--max-wait-ms", "2", *serve_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    return ServeLog(proc).follow()


def resident_mb(pid: int) -> float | None:
    """The process's resident memory (Linux /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def one_swap(server: ServeLog, root: Path, target: Path, calls: Calls, before_s: float) -> dict:
    time.sleep(before_s)
    mark = len(server.events)
    flipped = flip(root, target)
    swapped, line = server.event("bundle_swapped", after=mark, timeout_s=120)
    time.sleep(AFTER_SWAP_S + 0.2)
    with calls.lock:
        done = list(calls.done)
    before = [s for b, s in done if flipped - before_s <= b and b + s < flipped]
    during = [s for b, s in done if flipped <= b <= swapped + AFTER_SWAP_S]
    row = {"p99_before_ms": p99(before) * 1e3, "p99_during_ms": p99(during) * 1e3, "before_calls": len(before),
           "during_calls": len(during), "window_s": swapped - flipped, "swap_s": line.get("seconds"),
           "load_s": line.get("load_s"), "warm_s": line.get("warm_s"),
           "loader_pauses": line.get("pauses"), "loader_longest_slice_cpu_ms": line.get("longest_slice_cpu_ms"),
           "server_rss_mb": resident_mb(server.proc.pid)}
    row["ratio"] = row["p99_during_ms"] / row["p99_before_ms"]
    return row


def run(args: argparse.Namespace) -> int:
    check_args(args)
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        root = Path(tmp)
        versions = [root / "versions" / "a", root / "versions" / "b"]
        for v in versions:
            shutil.copytree(args.bundle, v, ignore=shutil.ignore_patterns("checkpoints"))
        os.symlink(versions[0], root / "current")
        server = start_server(root, args.serve_args.split())
        stop, calls, rows = threading.Event(), Calls(), []
        threads: list[threading.Thread] = []
        try:
            address = server.event("serving", timeout_s=300)[1]["address"]
            server.event("bundle_watching")
            users = [f"bench-swap-{i}" for i in range(args.callers)]
            ids = Bundle.open(versions[0]).load_ids().item_ids.tolist()
            with RecClient(address) as client:  # each caller's history: 6 of the bundle's items
                for n, user in enumerate(users):
                    client.record(user, ids[3 * n : 3 * n + 6])
            threads = [threading.Thread(target=caller, args=(address, u, calls, stop)) for u in users]
            for t in threads:
                t.start()
            for n in range(args.swaps):
                row = one_swap(server, root, versions[(n + 1) % 2], calls, args.before_s)
                rows.append(row)
                print(f"swap {n + 1}: p99 before {row['p99_before_ms']:.1f} ms ({row['before_calls']} calls), "
                      f"during {row['p99_during_ms']:.1f} ms ({row['during_calls']} calls, {row['window_s']:.2f} s)"
                      f": {row['ratio']:.2f}x; load {row['load_s']} s, warm-up {row['warm_s']} s, "
                      f"swap {row['swap_s']} s ({row['loader_pauses']} loader pauses); server resident "
                      f"{row['server_rss_mb'] or float('nan'):.0f} MB", flush=True)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            stop_process(server.proc)
    ratios = [r["ratio"] for r in rows]
    print(f"ratio p99 during / before over {len(rows)} swaps: min {min(ratios):.2f} median "
          f"{statistics.median(ratios):.2f} max {max(ratios):.2f}; {len(calls.done)} calls, "
          f"{len(calls.failed)} failed{': ' + calls.failed[0] if calls.failed else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps({"swaps": rows, "failed": len(calls.failed)}, indent=1))
    return 1 if calls.failed or len(rows) < args.swaps else 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="a bundle directory (copied twice: the two versions)")
    p.add_argument("--swaps", type=int, default=5, help="flips of `current` (default 5)")
    p.add_argument("--callers", type=int, default=4, help="caller threads, one call in flight each (default 4)")
    p.add_argument("--before-s", type=float, default=3.0, help="seconds of calls before each flip (default 3)")
    p.add_argument("--serve-args", default="--dtype fp32 --spec off",
                   help="more `recsvc serve` flags, one string (default: '--dtype fp32 --spec off')")
    p.add_argument("--json", help="write the per-swap rows to this file")


def check_args(args: argparse.Namespace) -> None:
    if args.swaps < 1 or args.callers < 1 or args.before_s <= 0:
        raise UserError("--swaps and --callers must be >= 1, --before-s > 0")
    if not (Path(args.bundle) / "bundle.json").is_file():
        raise UserError(f"not a bundle directory (no bundle.json): {args.bundle}")
