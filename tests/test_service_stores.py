"""History stores: in-process and Redis (a real redis-server on a free port)."""

from __future__ import annotations

import threading
import time
from contextlib import closing

import pytest

from harness.redis_server import free_port
from recsvc.service.stores import HistoryStoreUnavailable, InMemoryHistoryStore, open_store


def _hammer(store, users: int = 4, threads: int = 8, batches: int = 40) -> list[int]:
    """Each thread appends triples (t, i, t) to every user; returns every length append() reported."""
    lengths: list[int] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        for i in range(batches):
            for u in range(users):
                n = store.append(f"u{u}", [t + 1, 1000 + i, t + 1])
                with lock:
                    lengths.append(n)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return lengths


def _assert_whole_triples(items: list[int]) -> None:
    assert len(items) % 3 == 0
    for j in range(0, len(items), 3):
        a, b, c = items[j : j + 3]
        assert a == c and 1000 <= b < 2000, f"interleaved append at {j}: {items[j : j + 3]}"


def test_in_memory_append_get_trim():
    store = InMemoryHistoryStore(max_len=5)
    assert store.get("nobody") == []
    assert store.append("u", [1, 2, 3]) == 3
    assert store.append("u", [4, 5, 6, 7]) == 5
    assert store.get("u") == [3, 4, 5, 6, 7]
    assert store.get("other") == []


def test_in_memory_is_thread_safe_and_bounded():
    store = InMemoryHistoryStore(max_len=30)
    lengths = _hammer(store)
    assert max(lengths) == 30
    for u in range(4):
        items = store.get(f"u{u}")
        assert len(items) == 30
        _assert_whole_triples(items)
    lru = InMemoryHistoryStore(max_len=3, max_users=2)
    for user in ("a", "b", "c"):
        lru.append(user, [1])
    assert lru.get("a") == [] and lru.get("c") == [1]


def test_redis_append_trim_ttl_prefix(redis_server):
    import redis

    with closing(open_store(redis_server.url, max_len=5, ttl_s=100, prefix="t:")) as store:
        assert store.get("u") == []
        assert store.append("u", [1, 2, 3]) == 3
        assert store.append("u", [4, 5, 6, 7]) == 5
        assert store.get("u") == [3, 4, 5, 6, 7]
        assert 0 < store.ttl("u") <= 100
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.lrange("t:u", 0, -1) == [b"3", b"4", b"5", b"6", b"7"]
        raw.close()
        assert store.ping()


def test_redis_concurrent_appends_are_atomic(redis_server):
    with closing(open_store(redis_server.url, max_len=30)) as store:
        lengths = _hammer(store, users=3, threads=6, batches=20)
        assert max(lengths) == 30, "append must trim in the same transaction (length never above max_len)"
        for u in range(3):
            items = store.get(f"u{u}")
            assert len(items) == 30
            _assert_whole_triples(items)


def test_redis_ttl_expires(redis_server):
    with closing(open_store(redis_server.url, max_len=10, ttl_s=1)) as store:
        store.append("short", [1, 2])
        assert store.get("short") == [1, 2]
        deadline = time.monotonic() + 5
        while store.get("short") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.get("short") == []


def test_redis_unreachable_raises_unavailable_quickly():
    with closing(open_store(f"redis://127.0.0.1:{free_port()}/0", retries=2, backoff_s=0.01)) as store:
        started = time.monotonic()
        with pytest.raises(HistoryStoreUnavailable, match="redis get failed"):
            store.get("u")
        with pytest.raises(HistoryStoreUnavailable, match="redis append failed"):
            store.append("u", [1])
        assert time.monotonic() - started < 2.0
        assert not store.ping()


def test_redis_store_recovers_after_restart(persistent_redis_server):
    with closing(open_store(persistent_redis_server.url, retries=1, backoff_s=0.01)) as store:
        store.append("u", [1, 2])
        persistent_redis_server.stop()
        with pytest.raises(HistoryStoreUnavailable):
            store.get("u")
        with pytest.raises(HistoryStoreUnavailable):
            store.append("u", [3])
        persistent_redis_server.start()
        assert store.get("u") == [1, 2]  # same store object: stale pooled connections are replaced
        assert store.append("u", [3]) == 3
