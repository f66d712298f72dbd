"""``recsvc serve --processes N`` (N workers sharing the port through SO_REUSEPORT, SIGTERM forwarded, each
drains) and client-side load balancing (round_robin over several targets, UNAVAILABLE retried)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from service_helpers import json_line

from harness.redis_server import free_port
from recsvc.client.client import CHANNEL_OPTIONS, RecClient, channel_target
from recsvc.errors import UserError
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.gen import recommender_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]


def _kill(proc: subprocess.Popen, pids) -> None:
    """What a test leaves behind, killed: the parent process and any worker still alive."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_processes_2_share_the_port_and_drain_on_sigterm(tmp_path):
    counts = tmp_path / "pop.json"
    counts.write_text(json.dumps({str(i): 100 - i for i in range(1, 60)}))
    port = free_port()
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--popularity", str(counts), "--port", str(port),
           "--processes", "2", "--grace-s", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    entries: list[dict] = []
    lock = threading.Lock()

    def read() -> None:
        for line in proc.stderr:
            with lock:
                entries.append(json_line(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def events(name: str) -> list[dict]:
        with lock:
            return [e for e in entries if e.get("event") == name]

    worker_pids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(events("serving")) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, entries
            time.sleep(0.05)
        serving = events("serving")
        assert sorted(e["worker"] for e in serving) == [0, 1] and {e["port"] for e in serving} == {port}
        worker_pids = {e["pid"] for e in serving}
        assert len(worker_pids) == 2 and proc.pid not in worker_pids
        with RecClient(f"127.0.0.1:{port}") as client:
            assert client.health() == "SERVING"
        # separate connections (no shared subchannel): the kernel spreads them over the two listeners
        for i in range(24):
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
            with channel:
                reply = pb_grpc.RecommenderStub(channel).Recommend(
                    pb.RecommendRequest(user_id=f"u{i}", history=[1], k=3), timeout=10
                )
                assert [item.item_id for item in reply.items] == [1, 2, 3]
        deadline = time.monotonic() + 5
        while len(events("rpc")) < 24 and time.monotonic() < deadline:
            time.sleep(0.05)
        answered_by = {e["pid"] for e in events("rpc") if e.get("method") == "Recommend"}
        assert answered_by == worker_pids, answered_by  # P(all 24 connections on one worker) = 2**-23
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - began < 10
        reader.join(5)
        assert sorted(e["worker"] for e in events("stopped")) == [0, 1]
        assert events("workers_exited")[-1]["exitcodes"] == [0, 0]
        assert not [pid for pid in worker_pids if _alive(pid)]
    finally:
        _kill(proc, worker_pids)


def test_serve_processes_workers_exit_when_the_parent_is_killed(tmp_path):
    counts = tmp_path / "pop.json"
    counts.write_text(json.dumps({"1": 5, "2": 3}))
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--popularity", str(counts), "--port",
           str(free_port()), "--processes", "2", "--grace-s", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline
            entry = json_line(line)
            if entry.get("event") == "serving":
                pids.add(entry["pid"])
        proc.kill()
        proc.wait(5)
        deadline = time.monotonic() + 10
        while [pid for pid in pids if _alive(pid)]:
            assert time.monotonic() < deadline, "orphaned workers still running"
            time.sleep(0.1)
    finally:
        _kill(proc, pids)


def test_serve_processes_needs_an_explicit_port(tmp_path, capsys):
    from recsvc.cli.main import main

    counts = tmp_path / "pop.json"
    counts.write_text(json.dumps({"1": 5}))
    assert main(["serve", "--popularity", str(counts), "--port", "0", "--processes", "2"]) == 2
    assert "--processes 2 needs an explicit --port" in capsys.readouterr().err


def test_channel_target_lists():
    assert channel_target("127.0.0.1:5") == "127.0.0.1:5"
    assert channel_target("127.0.0.1:5,127.0.0.1:6") == "ipv4:127.0.0.1:5,127.0.0.1:6"
    assert channel_target("[::1]:5, [::1]:6") == "ipv6:[::1]:5,[::1]:6"
    assert channel_target("dns:///svc:5") == "dns:///svc:5"
    with pytest.raises(ValueError, match="dns:///"):
        channel_target("a:5,b:6")
    options = dict(CHANNEL_OPTIONS)
    config = json.loads(options["grpc.service_config"])
    assert options["grpc.enable_retries"] == 1 and config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED"]


def test_client_cli_rejects_a_host_name_list(capsys):
    import argparse

    from recsvc.client import cli as client_cli

    parser = argparse.ArgumentParser()
    client_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["client", "health", "--target", "a:1,b:2"])
    with pytest.raises(UserError, match="dns:///"):
        args.func(args)


def _load_through(client: RecClient, per_worker: int, history: list[int], k: int, mid_way, join_s: float
                  ) -> tuple[list[BaseException], int]:
    """4 threads send ``per_worker`` Recommend calls each; once a quarter is answered, ``mid_way()`` runs while the
    calls keep flowing. Returns (the failed calls' errors, calls that succeeded)."""
    failures: list[BaseException] = []
    done: list[int] = []
    sent = threading.Semaphore(0)

    def send(worker: int) -> None:
        for i in range(per_worker):
            try:
                assert client.recommend(f"u{worker}-{i}", history=history, k=k).items
                done.append(1)
            except grpc.RpcError as exc:
                failures.append(exc)
            sent.release()

    threads = [threading.Thread(target=send, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for _ in range(per_worker):
        sent.acquire()
    mid_way()
    for t in threads:
        t.join(join_s)
    return failures, len(done)


def test_round_robin_client_survives_a_server_stopping_mid_way(catalog, make_server):
    first, second = make_server(catalog), make_server(catalog)
    with RecClient(f"{first.address},{second.address}", timeout_s=10) as client:
        assert client.health() == "SERVING"
        # a quarter of the requests answered: drain one server while they keep flowing
        failures, done = _load_through(client, 100, [1], 3, lambda: first.stop(grace_s=0.5), 30)
    assert not failures and done == 400, failures[:3]
    served = [
        s.metrics.registry.get_sample_value("recsvc_requests_total", {"method": "Recommend", "code": "OK"}) or 0
        for s in (first, second)
    ]
    assert all(n > 0 for n in served) and sum(served) == 400, served  # both answered, none twice


def test_record_interactions_is_not_retried():
    config = json.loads(dict(CHANNEL_OPTIONS)["grpc.service_config"])
    retried = {name.get("method") for entry in config["methodConfig"] for name in entry["name"]}
    assert "RecordInteractions" not in retried and None not in retried


def test_readme_documents_the_service_config():
    from recsvc.client.client import SERVICE_CONFIG

    readme = (REPO / "deploy" / "README.md").read_text()  # the operator notes
    documented = readme.split("```json", 1)[1].split("```", 1)[0]
    assert json.loads(documented) == SERVICE_CONFIG


def _start_serve(counts: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--popularity", str(counts), "--port", "0",
           "--grace-s", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
                            text=True)
    deadline, lines = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if json_line(line).get("event") == "serving":
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, json_line(line)["address"]
    proc.kill()
    raise AssertionError("".join(lines))


def test_round_robin_client_survives_a_server_process_killed_mid_load(tmp_path):
    """Two real `recsvc serve` processes behind RecClient's round_robin + retry policy; one is SIGKILLed (no drain)
    while 4 threads keep sending: every call still succeeds (calls on the dead connection are replayed)."""
    counts = tmp_path / "pop.json"
    counts.write_text(json.dumps({str(i): 100 - i for i in range(1, 60)}))
    (a, addr_a), (b, addr_b) = _start_serve(counts), _start_serve(counts)

    def kill_a() -> None:  # a quarter answered: kill one server outright while calls keep flowing
        a.send_signal(signal.SIGKILL)
        a.wait(10)

    try:
        with RecClient(f"{addr_a},{addr_b}", timeout_s=10) as client:
            assert client.health() == "SERVING"
            failures, done = _load_through(client, 150, [1, 2], 5, kill_a, 60)
        assert not failures and done == 600, failures[:3]
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
