"""``recsvc serve --processes N`` as a child process for ``recsvc bench processes``: start (every worker's
"serving" log line, then health SERVING), per-worker Prometheus counters, and a clean stop (SIGTERM, wait,
SIGKILL of its process group on timeout)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

from recsvc.errors import UserError

STOP_TIMEOUT_S = 60.0


def free_port_run(n: int, attempts: int = 100) -> int:
    """The first of ``n`` consecutive free loopback TCP ports (a worker i serves metrics on first + i)."""
    from harness.redis_server import free_port

    for _ in range(attempts):
        first = free_port()
        if first + n - 1 > 65535:
            continue
        if all(_bindable(first + i) for i in range(1, n)):
            return first
    raise RuntimeError(f"no run of {n} free ports found")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class WorkerSample:
    """One worker's counters at one moment (from its /metrics)."""

    ok: float
    errors: dict[str, float]
    cpu_s: float
    batches: float
    batched_queries: float


class ServeProcess:
    """``recsvc serve --bundle B --processes N --port P --metrics-port M [serve_args]``; stdout and stderr
    (JSON log lines) go to ``log_path``."""

    def __init__(self, bundle: str, processes: int, serve_args: list[str], log_path: Path) -> None:
        from harness.redis_server import free_port

        self.processes = processes
        self.port = free_port()
        self.metrics_port = free_port_run(processes)
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--bundle", bundle,
                    "--processes", str(processes), "--host", "127.0.0.1", "--port", str(self.port),
                    "--metrics-port", str(self.metrics_port), "--grace-s", "5", *serve_args]
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float) -> list[dict]:
        """Starts the server and waits until all N workers have logged "serving" and the health service answers
        SERVING; returns the "serving" log entries (by worker). UserError with the log's tail when it exits or
        does not get there within ``timeout_s``."""
        import grpc

        from recsvc.client.client import RecClient

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        began = time.monotonic()
        with open(self.log_path, "wb") as log:
            # its own session: a Ctrl-C at the terminal reaches the bench only, which then stops the server
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = began + timeout_s
        with RecClient(self.target, timeout_s=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise UserError(f"recsvc serve --processes {self.processes} exited with "
                                    f"{self.proc.returncode}:\n{self.tail()}")
                serving = self.events("serving")
                if len(serving) >= self.processes:
                    try:
                        if client.health() == "SERVING":
                            self.startup_s = round(time.monotonic() - began, 3)
                            if self.processes == 1:  # a single process logs no worker index / pid
                                serving[0].setdefault("worker", 0)
                                serving[0].setdefault("pid", self.proc.pid)
                            return sorted(serving, key=lambda e: e.get("worker", 0))
                    except grpc.RpcError:
                        pass
                if time.monotonic() > deadline:
                    raise UserError(f"recsvc serve --processes {self.processes}: {len(serving)} of "
                                    f"{self.processes} workers serving after {timeout_s:.0f} s "
                                    f"(--startup-timeout-s):\n{self.tail()}")
                time.sleep(0.2)

    def sample(self) -> list[WorkerSample | None]:
        """Every worker's counters now (None for a worker whose /metrics does not answer)."""
        return [_scrape(self.metrics_port + i) for i in range(self.processes)]

    def stop(self) -> dict:
        """SIGTERM (the server forwards it to its workers, which drain), wait; SIGKILL to the process group
        after STOP_TIMEOUT_S. Returns the exit code (None: killed), the workers' exit codes and the seconds
        from SIGTERM to exit."""
        if self.proc is None:
            return {"exit_code": None, "worker_exit_codes": None, "stop_s": None}
        code: int | None
        began = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session: the serve process and its workers
            self.proc.wait()
        exited = self.events("workers_exited")
        return {"exit_code": code,
                "worker_exit_codes": exited[-1].get("exitcodes") if exited else ([code] if self.processes == 1
                                                                                 else None),
                "stop_s": round(time.monotonic() - began, 3)}

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"{name}"' in line:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == name:
                    out.append(entry)
        return out

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _scrape(port: int) -> WorkerSample | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    ok = cpu = batches = queries = 0.0
    errors: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "recsvc_requests_total" and s.labels.get("method") == "Recommend":
                if s.labels.get("code") == "OK":
                    ok = s.value
                else:
                    errors[s.labels.get("code", "?")] = s.value
            elif s.name == "process_cpu_seconds_total":
                cpu = s.value
            elif s.name == "recsvc_batch_size_count":
                batches = s.value
            elif s.name == "recsvc_batch_size_sum":
                queries = s.value
    return WorkerSample(ok, errors, cpu, batches, queries)
