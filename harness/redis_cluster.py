"""Starts a private Redis Cluster on loopback: 6 ``redis-server`` processes, 3 masters + 3 replicas (tests, the
failover drill, local demos). Not used by the server itself.

Each node is a :class:`RedisProcess` on a free port with ``cluster-enabled yes`` and its own data directory (its
``nodes.conf`` survives :meth:`RedisClusterProcesses.kill` + :meth:`RedisClusterProcesses.restart`, so a killed
node rejoins the cluster; a killed master comes back as a replica of the replica that took over). The cluster
is formed by ``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes``; :meth:`start` returns once
every node reports ``cluster_state:ok`` and all 16384 slots served.

Settings chosen for a cluster that keeps serving while a shard fails over: ``cluster-node-timeout``
(``node_timeout_ms``; Redis's default is 15000) bounds failure detection, ``cluster-require-full-coverage no``
keeps the other shards answering while one has no master, ``repl-diskless-sync-delay 0`` lets a rejoining
replica sync at once.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from harness.redis_server import RedisProcess, free_port

SLOTS = 16384


def redis_cli_path() -> str | None:
    return shutil.which("redis-cli")


class ClusterNodeProcess(RedisProcess):
    """One cluster node: a :class:`RedisProcess` with ``cluster-enabled yes``; :meth:`kill` is a SIGKILL."""

    def __init__(self, *, data_dir: Path, node_timeout_ms: int, appendfsync: str) -> None:
        super().__init__(data_dir=data_dir, port=_free_cluster_port())
        self.node_timeout_ms = node_timeout_ms
        self.appendfsync = appendfsync

    def _command(self) -> list[str]:
        cmd = super()._command()
        cmd[cmd.index("--appendfsync") + 1] = self.appendfsync
        cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        cmd += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        cmd += ["--cluster-require-full-coverage", "no", "--repl-diskless-sync-delay", "0"]
        cmd += ["--shutdown-timeout", "1"]  # a master's SIGTERM waits at most 1 s for lagging replicas
        return cmd

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush (a crashed host)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def client(self, timeout_s: float = 1.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 <= 65535:
            try:
                with _bound(port + 10000):
                    return port
            except OSError:
                continue
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def _bound(port: int):
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


class RedisClusterProcesses:
    """``masters`` masters with ``replicas`` replicas each on 127.0.0.1; a context manager (start / close)."""

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 2000,
        appendfsync: str = "everysec",
        data_dir: str | Path | None = None,
    ) -> None:
        if redis_cli_path() is None:
            raise FileNotFoundError("redis-cli is not installed (apt-get install -y redis-tools)")
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="recsvc-cluster-")
        root = Path(data_dir) if data_dir else Path(self._tmp.name)
        self.replicas = replicas
        self.nodes: list[ClusterNodeProcess] = []
        for i in range(masters * (1 + replicas)):
            node_dir = root / f"node-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            self.nodes.append(ClusterNodeProcess(data_dir=node_dir, node_timeout_ms=node_timeout_ms,
                                                 appendfsync=appendfsync))

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed (what ``recsvc serve --redis-url`` takes)."""
        return "redis+cluster://" + ",".join(self.addresses)

    def start(self, timeout_s: float = 30.0) -> RedisClusterProcesses:
        try:
            for node in self.nodes:
                node.start()
            cmd = [redis_cli_path(), "--cluster", "create", *self.addresses]
            cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {(done.stdout + done.stderr)[-800:]}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node says ``cluster_state:ok`` with all slots served (TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._node_ok(node) for node in self.nodes if node.running()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not reach cluster_state:ok within {timeout_s:.0f} s")
            time.sleep(0.1)

    @staticmethod
    def _node_ok(node: ClusterNodeProcess) -> bool:
        try:
            with node.client() as client:
                info = client.cluster("INFO")
        except redis.RedisError:
            return False
        if isinstance(info, (bytes, str)):
            text = info.decode() if isinstance(info, bytes) else info
            info = dict(line.split(":", 1) for line in text.split() if ":" in line)
        return info.get("cluster_state") == "ok" and int(info.get("cluster_slots_ok", 0)) == SLOTS

    def roles(self) -> dict[int, str]:
        """``{node index: "master" | "slave"}`` of the running nodes (ROLE on each)."""
        roles = {}
        for i, node in enumerate(self.nodes):
            if not node.running():
                continue
            try:
                with node.client() as client:
                    role = client.execute_command("ROLE")[0]
            except redis.RedisError:
                continue
            roles[i] = role.decode() if isinstance(role, bytes) else str(role)
        return roles

    def masters(self) -> list[int]:
        return sorted(i for i, role in self.roles().items() if role == "master")

    def owners(self, keys: list[str]) -> dict[str, int]:
        """``{key: index of the master serving its slot}`` from CLUSTER SLOTS of the first running node that
        answers ({} when none does)."""
        from redis.crc import key_slot

        for node in self.nodes:
            if not node.running():
                continue
            try:
                with node.client() as client:
                    ranges = client.execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                continue
            by_port = {n.port: i for i, n in enumerate(self.nodes)}
            out = {}
            for key in keys:
                slot = key_slot(key.encode())
                for first, last, master, *_ in ranges:
                    if int(first) <= slot <= int(last) and int(master[1]) in by_port:
                        out[key] = by_port[int(master[1])]
            return out
        return {}

    def kill(self, index: int) -> None:
        self.nodes[index].kill()

    def restart(self, index: int) -> None:
        self.nodes[index].start()

    def close(self) -> None:
        for node in self.nodes:  # SIGTERM to all first: no master waits on a replica stopped before it
            if node.running():
                node.proc.terminate()
        for node in self.nodes:
            node.stop(timeout_s=5.0)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisClusterProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
