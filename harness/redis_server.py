"""Starts a private ``redis-server`` process on a free localhost port (the tests and the drills).

Not used by the server itself. Every spawned server runs with ``appendonly yes`` and ``appendfsync always``
(the settings the service's "acknowledged = durable" promise needs, see deploy/README.md, "Notes for
operators"), so data survives :meth:`RedisProcess.restart` (an outage drill) as long as ``data_dir`` is kept.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisProcess:
    """One ``redis-server`` child process; ``start`` / ``stop`` / ``restart`` keep the same port."""

    def __init__(
        self, *, data_dir: str | Path | None = None, port: int | None = None
    ):
        binary = redis_server_path()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
        self.binary = binary
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="recsvc-redis-")
        self.data_dir = Path(data_dir) if data_dir else Path(self._tmp.name)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        cmd += ["--save", "", "--daemonize", "no", "--loglevel", "warning"]
        cmd += ["--appendonly", "yes", "--appendfsync", "always"]  # an acknowledged write is on disk
        return cmd

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        if self.proc is not None and self.proc.poll() is None:
            return self
        with open(self.data_dir / "redis.log", "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.data_dir / "redis.log").read_text(errors="replace")[-500:]
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}: {tail}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes its append-only file and exits), SIGKILL after ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> RedisProcess:
        self.stop()
        return self.start()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
