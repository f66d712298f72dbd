"""The history store on a real Redis Cluster (6 redis-server processes on loopback: 3 masters, 3 replicas):
URLs and flags, reads / writes / trim / TTL, one slot per user, the gRPC server on the cluster, WAIT on vs off,
and a master killed under load (UNAVAILABLE or OK only, recovery without a restart, no acknowledged write lost
with WAIT on)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections import Counter

import grpc
import pytest
from redis.crc import key_slot
from test_service_stores import _assert_whole_triples, _hammer

from recsvc.client.client import RecClient
from recsvc.service.rpc.server import STORE_HEALTH_NAME
from recsvc.service.stores import HistoryStoreUnavailable, open_store
from recsvc.service.stores.redis_urls import ClusterURL, parse_cluster_url, redacted

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server / redis-cli are not installed (apt-get install -y redis-server)",
)


def _spawn(node_timeout_ms: int = 1000):
    from harness.redis_cluster import RedisClusterProcesses

    return RedisClusterProcesses(node_timeout_ms=node_timeout_ms).start()


@pytest.fixture(scope="module")
def cluster():
    procs = _spawn()
    yield procs
    procs.close()


def _code(fn) -> str:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


# --- URLs and flags ---------------------------------------------------------------------------------------------


def test_cluster_urls():
    assert parse_cluster_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001") == ClusterURL(
        (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    )
    parsed = parse_cluster_url("rediss+cluster://app:s%40cret@[::1]:7000,redis-0/0")
    assert parsed == ClusterURL((("::1", 7000), ("redis-0", 6379)), "app", "s@cret", ssl=True)
    for bad, why in [("redis+cluster://", "at least one"), ("redis+cluster://h:0", "port"),
                     ("redis+cluster://h:x", "port"), ("redis+cluster://h:1/2", "database 0"),
                     ("redis+cluster://:1", "without a host"), ("redis://h:1", "expected redis\\+cluster")]:
        with pytest.raises(ValueError, match=why):
            parse_cluster_url(bad)
    assert redacted("redis+cluster://u:pw@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redacted("redis://a:1/0") == "redis://a:1/0"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--redis-url", "redis+cluster://h:99999"], "not a port"),
        (["--redis-url", "redis+cluster://h:1/3"], "database 0"),
        (["--redis-wait-replicas", "-1"], "must be >= 0"),
        (["--redis-wait-timeout-ms", "0"], "must be >= 1"),
    ],
)
def test_serve_rejects_bad_redis_flags(tmp_path, capsys, flags, message):
    from recsvc.cli.main import main

    counts = tmp_path / "pop.json"
    counts.write_text('{"1": 3}')
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--popularity", str(counts), "--port", "0", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--redis-wait-replicas", "1"], "--redis-wait-replicas needs --redis-url"),
        (["--redis-url", "redis+cluster://127.0.0.1:1", "--redis-prefix", "a{b}:"], "cannot contain"),
    ],
)
def test_serve_rejects_settings_that_cannot_work(tmp_path, capsys, flags, message):
    from recsvc.cli.main import main

    counts = tmp_path / "pop.json"
    counts.write_text('{"1": 3}')
    assert main(["serve", "--popularity", str(counts), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# --- the store on a real cluster --------------------------------------------------------------------------------


def test_cluster_store_append_get_trim_ttl(cluster):
    from redis.cluster import RedisCluster

    store = open_store(cluster.url, max_len=5, ttl_s=100, prefix="t:")
    raw = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        assert store.ping() and store.get("u") == []
        assert store.append("u", [1, 2, 3]) == 3
        assert store.append("u", [4, 5, 6, 7]) == 5
        assert store.get("u") == [3, 4, 5, 6, 7]
        assert 0 < store.ttl("u") <= 100
        assert raw.lrange("t:{u}", 0, -1) == [b"3", b"4", b"5", b"6", b"7"]
        big = open_store(cluster.url, max_len=5000)
        assert big.append("many", list(range(1, 2501))) == 2500  # more values than one Lua unpack takes
        assert big.get("many") == list(range(1, 2501))
        big.close()
        atomic = open_store(cluster.url, max_len=30, prefix="atomic:")
        lengths = _hammer(atomic, users=3, threads=6, batches=15)
        assert max(lengths) == 30
        for u in range(3):
            _assert_whole_triples(atomic.get(f"u{u}"))
        atomic.close()
    finally:
        raw.close()
        store.close()


def test_one_users_keys_live_on_one_slot(cluster):
    store = open_store(cluster.url, prefix="recsvc:hist:")
    try:
        users = [f"user-{i}" for i in range(60)] + ["odd{id", "with:colons", "ünïcode"]
        for user in users:
            key = store.key(user)
            assert key == f"recsvc:hist:{{{user}}}"
            # any key tagged with the user id lands on the user's slot
            assert key_slot(key.encode()) == key_slot(f"other:{{{user}}}:x".encode()) == key_slot(user.encode())
            store.append(user, [1])
        owners = cluster.owners([store.key(user) for user in users])
        assert set(owners.values()) == set(cluster.masters()), "users spread over all three masters"
        for user in users[:10]:  # the data is on the master that owns the slot
            with cluster.nodes[owners[store.key(user)]].client() as node:
                assert node.lrange(store.key(user), 0, -1) == [b"1"]
    finally:
        store.close()


def test_server_on_the_cluster(cluster, catalog, make_server):
    store = open_store(cluster.url, max_len=200, prefix="srv:")
    try:
        server = make_server(catalog, store)
        with RecClient(server.address, timeout_s=5) as client:
            assert client.record("alice", [1, 2, 3]) == 3
            assert client.record("alice", [4]) == 4
            assert client.history("alice") == [1, 2, 3, 4]
            reply = client.recommend("alice", k=2, exclude_history=True)
            assert [item.item_id for item in reply.items] == [5, 6] and not reply.fallback_reason
            assert client.history("nobody") == []
            assert client.health(STORE_HEALTH_NAME) == "SERVING"
    finally:
        store.close()


def test_wait_on_vs_off(cluster, catalog, make_server):
    """WAIT 1 acknowledges only what the replica has: with the replica frozen (SIGSTOP) a write is UNAVAILABLE
    with WAIT on and acknowledged with WAIT off (lost if the master died then); WAIT for more replicas than
    exist is never acknowledged."""
    on = open_store(cluster.url, prefix="wait:", wait_replicas=1, wait_timeout_ms=100)
    off = open_store(cluster.url, prefix="wait:")
    too_many = open_store(cluster.url, prefix="wait:", wait_replicas=2, wait_timeout_ms=50)
    try:
        server_on, server_off = make_server(catalog, on), make_server(catalog, off)
        server_too_many = make_server(catalog, too_many)
        with RecClient(server_on.address, timeout_s=5) as client_on, \
                RecClient(server_off.address, timeout_s=5) as client_off, \
                RecClient(server_too_many.address, timeout_s=5) as client_too_many:
            assert client_on.record("w", [1]) == 1
            master = cluster.owners([on.key("w")])[on.key("w")]
            replica = _replica_of(cluster, master)
            with cluster.nodes[replica].client() as node:
                node.execute_command("READONLY")
                assert node.lrange(on.key("w"), 0, -1) == [b"1"]  # acknowledged => on the replica
            with pytest.raises(grpc.RpcError) as failed:
                client_too_many.record("w", [2])
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert failed.value.details() == "history store unavailable"
            os.kill(cluster.nodes[replica].proc.pid, signal.SIGSTOP)
            try:
                assert _code(lambda: client_on.record("w", [3])) == "UNAVAILABLE"
                assert client_off.record("w", [4]) >= 2  # acknowledged with no replica having it
            finally:
                os.kill(cluster.nodes[replica].proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while _code(lambda: client_on.record("w", [5])) != "OK":
                assert time.monotonic() < deadline, "WAIT writes did not succeed again after the replica resumed"
                time.sleep(0.05)
            assert client_on.health() == "SERVING"
    finally:
        for store in (on, off, too_many):
            store.close()


def _replica_of(cluster, master: int) -> int:
    with cluster.nodes[master].client() as node:
        replicas = node.info("replication")
    port = int(replicas["slave0"]["port"])
    return next(i for i, n in enumerate(cluster.nodes) if n.port == port)


def test_wait_on_a_standalone_redis_without_replicas(redis_server):
    store = open_store(redis_server.url, wait_replicas=1, wait_timeout_ms=20)
    try:
        with pytest.raises(HistoryStoreUnavailable, match="0 of 1 replicas"):
            store.append("u", [1])
        assert store.get("u") == [1]  # applied on the master, not acknowledged: documented
    finally:
        store.close()


# --- failover -----------------------------------------------------------------------------------------------------


def test_master_killed_under_load(catalog, make_server):
    procs = _spawn()
    store = open_store(procs.url, max_len=5000, prefix="fo:", wait_replicas=1, wait_timeout_ms=200,
                       retry_budget_s=0.5)
    stop = threading.Event()
    codes: dict[str, Counter] = {"record": Counter(), "stored": Counter(), "inline": Counter()}
    acked: dict[str, list[int]] = {}
    try:
        server = make_server(catalog, store)
        mine = [[f"fo-{t}-{i}" for i in range(40)] for t in range(4)]  # the threads' own users
        owners = procs.owners([store.key(user) for users in mine for user in users])
        victim = owners[store.key(mine[0][0])]
        mine = [[u for u in users if owners[store.key(u)] == victim][:1]
                + [u for u in users if owners[store.key(u)] != victim][:1] for users in mine]
        on_victim = [users[0] for users in mine]
        lock = threading.Lock()

        def worker(t: int) -> None:
            seq = Counter()  # write n of a user stores item n (the catalog has items 1..2000)
            with RecClient(server.address, timeout_s=5) as client:
                while not stop.is_set():
                    for user in mine[t]:
                        seq[user] += 1
                        n = seq[user]
                        code = _code(lambda: client.record(user, [n])) if n <= 2000 else "OK"  # noqa: B023
                        with lock:
                            codes["record"][code] += 1
                            if code == "OK" and n <= 2000:
                                acked.setdefault(user, []).append(n)
                        # the calls run outside the lock: one read stalled by the failover must not hold up the others
                        stored = _code(lambda: client.recommend(user, k=3))  # noqa: B023
                        inline = _code(lambda: client.recommend(user, history=[1, 2], k=3))  # noqa: B023
                        with lock:
                            codes["stored"][stored] += 1
                            codes["inline"][inline] += 1
                    time.sleep(0.01)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        with lock:
            assert set(codes["record"]) == {"OK"}, codes
        procs.kill(victim)
        with RecClient(server.address, timeout_s=5) as client:
            deadline = time.monotonic() + 20  # failure detection (1 s node timeout) + election
            while procs.owners([store.key(on_victim[0])]).get(store.key(on_victim[0])) == victim:
                assert time.monotonic() < deadline, "no replica took over"
                time.sleep(0.1)
            deadline = time.monotonic() + 10
            while _code(lambda: client.history(on_victim[0])) != "OK":  # reads recover without a restart
                assert time.monotonic() < deadline, "reads did not recover after the promotion"
                time.sleep(0.1)
            # WAIT 1: the promoted master has no replica until the killed node comes back as one
            assert _code(lambda: client.record(on_victim[0], [1])) == "UNAVAILABLE"
            deadline = time.monotonic() + 10  # the load sees the same refusal before the killed node comes back
            while True:
                with lock:
                    if codes["record"]["UNAVAILABLE"] > 0:
                        break
                assert time.monotonic() < deadline, f"no write of the load was refused while unreplicated: {codes}"
                time.sleep(0.05)
            procs.restart(victim)
            deadline = time.monotonic() + 20
            while _code(lambda: client.record(on_victim[0], [1])) != "OK":
                assert time.monotonic() < deadline, "writes did not recover after the replica rejoined"
                time.sleep(0.1)
            time.sleep(0.5)
            stop.set()
            for t in threads:
                t.join(30)
            assert client.health() == "SERVING"
            for user, items in acked.items():
                history = set(client.history(user))
                assert not [n for n in items if n not in history], f"acknowledged writes of {user} lost"
        assert set(codes["record"]) <= {"OK", "UNAVAILABLE"} and set(codes["stored"]) <= {"OK", "UNAVAILABLE"}
        assert set(codes["inline"]) == {"OK"}, codes  # calls that need no store never fail
        assert codes["record"]["UNAVAILABLE"] > 0 and codes["record"]["OK"] > 0, codes
    finally:
        stop.set()
        store.close()
        procs.close()


def test_a_store_opened_while_the_cluster_is_down_connects_when_it_is_back():
    procs = _spawn()
    try:
        first = open_store(procs.url, prefix="down:")
        first.append("u", [1, 2])
        for node in procs.nodes:  # the whole cluster down (SIGTERM: each node keeps its data and nodes.conf)
            node.stop()
        store = open_store(procs.url, prefix="down:", retry_budget_s=0.2)
        started = time.monotonic()
        with pytest.raises(HistoryStoreUnavailable):
            store.get("u")
        with pytest.raises(HistoryStoreUnavailable):
            first.get("u")
        assert not store.ping() and time.monotonic() - started < 3.0
        for node in procs.nodes:
            node.start()
        procs.wait_ok()
        deadline = time.monotonic() + 15
        while True:
            try:
                assert store.get("u") == [1, 2] and first.get("u") == [1, 2]
                break
            except HistoryStoreUnavailable:
                assert time.monotonic() < deadline, "the stores did not reconnect"
                time.sleep(0.2)
        assert store.append("u", [3]) == 3 and store.ping()
        first.close()
        store.close()
    finally:
        procs.close()
