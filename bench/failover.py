"""``recsvc bench failover``: the Redis Cluster failover drill.

Spawns a Redis Cluster on loopback (6 redis-server processes: 3 masters, 3 replicas), starts ``recsvc serve``
on it (a separate process, popularity engine: the drill is about the history store), drives it with
``--concurrency`` client threads for ``--duration`` seconds (40 % RecordInteractions, 25 % Recommend on the
stored history, 15 % GetHistory, 20 % Recommend with an inline history), SIGKILLs one master at ``--kill-at``
seconds and restarts that redis-server ``--rejoin-after`` seconds later (an orchestrator restarting the pod: it
comes back as a replica). Reports server crashes, results by call type and status code (as the clients saw
them, after the client's retry policy, and as the server answered them), the time to recovery after the kill,
and acknowledged writes lost: every acknowledged write (user, sequence number) is recorded at the client and
looked up in the user's history read back after the run. ``--wait-replicas 1`` runs the server with
``--redis-wait-replicas 1``. Exit status 1 when the server crashed, an unexpected status was seen, or (with
WAIT on) an acknowledged write was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.request import urlopen

from recsvc.errors import UserError

from .failover_load import CALL_TYPES, STORED, Ledger, lost_writes, run_load, user_ids

CATALOG_ITEMS = 50_000  # item n is the n-th write of a user: a user may write this many times


def _positive(cast):
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)

# one line of `recsvc bench --help`
HELP = "Redis Cluster failover drill: a master killed under load, errors, recovery, acknowledged writes lost"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default="spawn",
                   help="'spawn': a private 6-node Redis Cluster on loopback (the drill kills one of its masters, "
                        "so it must own the cluster; default: %(default)s)")
    p.add_argument("--duration", type=_positive(float), default=60.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--concurrency", type=_positive(int), default=16, help="client threads (default: %(default)s)")
    p.add_argument("--wait-replicas", type=_non_negative_int, default=0,
                   help="the server's --redis-wait-replicas (0 = WAIT off; default: %(default)s)")
    p.add_argument("--wait-timeout-ms", type=_positive(int), default=500,
                   help="the server's --redis-wait-timeout-ms (default: %(default)s)")
    p.add_argument("--kill-at", type=_positive(float), help="seconds into the load (default: a third of --duration)")
    p.add_argument("--rejoin-after", type=float, default=10.0,
                   help="restart the killed redis-server this many seconds after the kill; 0 = never "
                        "(default: %(default)s)")
    p.add_argument("--node-timeout-ms", type=_positive(int), default=2000,
                   help="cluster-node-timeout of the spawned nodes (failure detection; default: %(default)s)")
    p.add_argument("--users-per-thread", type=_positive(int), default=8, help="default: %(default)s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the report here")


def run(args: argparse.Namespace) -> None:
    if args.cluster != "spawn":
        raise UserError("--cluster takes 'spawn' only: the drill kills a master, so it must own the cluster")
    kill_at = args.kill_at if args.kill_at is not None else args.duration / 3.0
    if not kill_at < args.duration or args.rejoin_after < 0:
        raise UserError(f"--kill-at must fall inside --duration ({args.duration} s) and --rejoin-after be >= 0")
    report = run_drill(duration=args.duration, concurrency=args.concurrency, wait_replicas=args.wait_replicas,
                       wait_timeout_ms=args.wait_timeout_ms, kill_at=kill_at, rejoin_after=args.rejoin_after,
                       node_timeout_ms=args.node_timeout_ms, users_per_thread=args.users_per_thread, seed=args.seed)
    text = json.dumps(report, indent=2) + "\n"
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(text, encoding="utf-8")
    print(text, end="")
    print(markdown_summary(report))
    if not report["verified"]:
        raise SystemExit(1)


# --- the drill ------------------------------------------------------------------------------------------------


def run_drill(*, duration: float, concurrency: int, wait_replicas: int = 0, wait_timeout_ms: int = 500,
              kill_at: float, rejoin_after: float = 10.0, node_timeout_ms: int = 2000, users_per_thread: int = 8,
              seed: int = 0) -> dict:
    from harness.redis_cluster import RedisClusterProcesses

    with tempfile.TemporaryDirectory(prefix="recsvc-drill-") as tmp, \
            RedisClusterProcesses(node_timeout_ms=node_timeout_ms, data_dir=Path(tmp) / "cluster") as cluster:
        server = _Server(Path(tmp), cluster.url, wait_replicas, wait_timeout_ms)
        try:
            server.start()
            report = _drive(cluster, server, duration=duration, concurrency=concurrency, kill_at=kill_at,
                            rejoin_after=rejoin_after, users_per_thread=users_per_thread, seed=seed)
            report["server"] = server.stop()
        finally:
            server.kill()
    report["cluster"] = {"nodes": 6, "masters": 3, "replicas_per_master": 1, "node_timeout_ms": node_timeout_ms}
    report["wait_replicas"] = wait_replicas
    report["wait_timeout_ms"] = wait_timeout_ms if wait_replicas else None
    report["verified"] = (
        report["server_crashes"] == 0
        and report["server"]["exit_code"] == 0
        and report["unexpected_errors"] == 0
        and report["unread_users"] == 0
        and (report["lost"] == 0 or not wait_replicas)
    )
    return report


def _drive(cluster, server: _Server, *, duration: float, concurrency: int, kill_at: float, rejoin_after: float,
           users_per_thread: int, seed: int) -> dict:
    users = user_ids(concurrency, users_per_thread)
    everyone = [u for mine in users for u in mine]
    stop = threading.Event()
    ledgers: list[Ledger] = []
    load = threading.Thread(target=lambda: ledgers.extend(run_load(server.target, users, stop, seed=seed)))
    began = time.monotonic()
    load.start()
    events: dict[str, float | None] = {"promoted": None, "restarted": None, "resynced": None}
    crashed_at = server.watch(until=began + kill_at)
    owners = cluster.owners([_key(user) for user in everyone])
    victim = owners[_key(everyone[0])]
    killed_at = time.monotonic()
    cluster.kill(victim)
    while time.monotonic() < began + duration and crashed_at is None:
        now = time.monotonic()
        if events["promoted"] is None and cluster.owners([_key(everyone[0])]).get(_key(everyone[0])) != victim:
            events["promoted"] = now
        if rejoin_after and events["restarted"] is None and now >= killed_at + rejoin_after:
            cluster.restart(victim)
            events["restarted"] = time.monotonic()
        if events["restarted"] and events["resynced"] is None and _link_up(cluster.nodes[victim]):
            events["resynced"] = time.monotonic()
        crashed_at = server.watch(until=min(began + duration, time.monotonic() + 0.1))
    stop.set()
    load.join()
    histories = _read_back(server.target, everyone)
    acked: dict[str, list[int]] = {}
    for ledger in ledgers:
        acked.update(ledger.acked)
    calls = sorted((c for ledger in ledgers for c in ledger.calls), key=lambda c: c.at)
    on_victim = {user for user in everyone if owners[_key(user)] == victim}
    report = {
        "duration_s": duration,
        "concurrency": concurrency,
        "users": len(everyone),
        "users_on_killed_master": len(on_victim),
        "timeline_s": {
            "kill": round(killed_at - began, 3),
            **{f"{name}_after_kill": None if at is None else round(at - killed_at, 3) for name, at in events.items()},
        },
        "calls": _by_type(calls),
        "errors_by_code": dict(Counter(c.code for c in calls if c.code != "OK")),
        "errors_before_kill": dict(Counter(c.code for c in calls if c.code != "OK" and c.at < killed_at)),
        "unexpected_errors": _unexpected(calls, killed_at),
        "recovery_after_kill_s": _recovery(calls, killed_at, began + duration),
        "acknowledged_writes": sum(len(v) for v in acked.values()),
        **lost_writes(acked, histories),
        "unread_users": len(everyone) - len(histories),
        "server_crashes": 0 if crashed_at is None else 1,
    }
    report["server_answers"] = server.answers()
    return report


def _key(user: str) -> str:
    return f"recsvc:hist:{{{user}}}"


def _link_up(node) -> bool:
    import redis

    try:
        with node.client() as client:
            info = client.info("replication")
    except redis.RedisError:
        return False
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def _by_type(calls) -> dict[str, dict[str, int]]:
    table: dict[str, Counter] = {kind: Counter() for kind in CALL_TYPES}
    for c in calls:
        table[c.kind][c.code] += 1
    return {kind: dict(sorted(codes.items())) for kind, codes in table.items()}


def _unexpected(calls, killed_at: float) -> int:
    """Failures that the drill does not allow: any before the kill, any of a call that needs no store, any
    code but UNAVAILABLE."""
    return sum(1 for c in calls if c.code != "OK"
               and (c.at < killed_at or c.kind not in STORED or c.code != "UNAVAILABLE"))


def _recovery(calls, killed_at: float, ended_at: float) -> dict:
    """Seconds from the kill to the last failed call (of stored-history reads, of writes, of either): from then
    on every call succeeded. None: nothing failed; "not recovered" when failures reach the last second."""
    out: dict = {}
    for name, kinds in (("reads", {"recommend_stored", "history"}), ("writes", {"record"}), ("all", STORED)):
        failed = [c.at for c in calls if c.kind in kinds and c.code != "OK" and c.at >= killed_at]
        if not failed:
            out[name] = None
        elif failed[-1] > ended_at - 1.0:
            out[name] = "not recovered"
        else:
            out[name] = round(failed[-1] - killed_at, 3)
    return out


def _read_back(target: str, users: list[str], budget_s: float = 30.0) -> dict[str, list[int]]:
    """Every user's final history (GetHistory, retried while the store answers UNAVAILABLE)."""
    import grpc

    from recsvc.client.client import RecClient

    out: dict[str, list[int]] = {}
    deadline = time.monotonic() + budget_s
    with RecClient(target, timeout_s=10) as client:
        for user in users:
            while time.monotonic() < deadline:
                try:
                    out[user] = client.history(user)
                    break
                except grpc.RpcError:
                    time.sleep(0.2)
    return out


# --- the server process -----------------------------------------------------------------------------------------


class _Server:
    """``recsvc serve --popularity`` on the cluster, a child process; its JSON log goes to a file."""

    def __init__(self, tmp: Path, redis_url: str, wait_replicas: int, wait_timeout_ms: int) -> None:
        from harness.redis_server import free_port

        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        counts = tmp / "popularity.json"
        counts.write_text(json.dumps({str(i): CATALOG_ITEMS + 1 - i for i in range(1, CATALOG_ITEMS + 1)}))
        self.log_path = tmp / "server.log"
        self.cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--popularity", str(counts),
                    "--redis-url", redis_url, "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                    "--max-history", str(CATALOG_ITEMS), "--redis-wait-replicas", str(wait_replicas),
                    "--redis-wait-timeout-ms", str(wait_timeout_ms), "--grace-s", "2", "--log-level", "WARNING"]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        import grpc

        from recsvc.client.client import RecClient

        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        with RecClient(self.target, timeout_s=1.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"recsvc serve exited with {self.proc.returncode}: {self._tail()}")
                try:
                    if client.health() == "SERVING":
                        return
                except grpc.RpcError:  # not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"recsvc serve was not SERVING within {timeout_s:.0f} s: {self._tail()}")
                time.sleep(0.1)

    def watch(self, until: float) -> float | None:
        """Sleeps until ``until``; the time the server process died, if it did."""
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                return time.monotonic()
            time.sleep(min(0.05, max(0.0, until - time.monotonic())))
        return time.monotonic() if self.proc.poll() is not None else None

    def answers(self) -> dict[str, dict[str, int]]:
        """recsvc_requests_total by method and code, from the server's /metrics."""
        try:
            with urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return {}
        out: dict[str, dict[str, int]] = {}
        for line in text.splitlines():
            if line.startswith("recsvc_requests_total{"):
                labels, value = line[len("recsvc_requests_total{"):].split("} ")
                fields = dict(part.split("=", 1) for part in labels.split(","))
                method, code = fields["method"].strip('"'), fields["code"].strip('"')
                out.setdefault(method, {})[code] = int(float(value))
        return out

    def stop(self) -> dict:
        """SIGTERM (drain); the exit code and the log's error lines."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        return {"exit_code": code, "log_errors": self._tail(errors_only=True)}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _tail(self, errors_only: bool = False) -> str | list[str]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        if errors_only:
            return [line[:300] for line in lines if '"level": "ERROR"' in line or "Traceback" in line][:10]
        return "\n".join(lines[-20:])


# --- reporting --------------------------------------------------------------------------------------------------


def markdown_summary(report: dict) -> str:
    lines = ["| call | results by code |", "|---|---|"]
    for kind, codes in report["calls"].items():
        lines.append(f"| {kind} | {', '.join(f'{c}: {n}' for c, n in codes.items()) or '-'} |")
    r = report["recovery_after_kill_s"]
    lines.append(
        f"\nWAIT replicas: {report['wait_replicas']}; server crashes: {report['server_crashes']}; "
        f"unexpected errors: {report['unexpected_errors']}; recovery after the kill (s): reads {r['reads']}, "
        f"writes {r['writes']}; acknowledged writes: {report['acknowledged_writes']}, lost: {report['lost']}"
    )
    return "\n".join(lines)
