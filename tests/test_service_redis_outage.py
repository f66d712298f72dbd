"""Redis stopped/restarted under a running server: UNAVAILABLE while down, recovery, no acked write lost."""

from __future__ import annotations

import threading
import time

import grpc

from recsvc.client.client import RecClient
from recsvc.service.stores import open_store


def _status(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _is_subsequence(needle: list[int], haystack: list[int]) -> bool:
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


def test_outage_degrades_and_recovers(catalog, make_server, persistent_redis_server):
    redis_proc = persistent_redis_server
    store = open_store(redis_proc.url, max_len=5000, retries=1, backoff_s=0.01, socket_timeout_s=0.3)
    acked: list[int] = []  # items of acknowledged RecordInteractions of user "writer", in order
    writer_codes: dict[str, int] = {}
    stop_writer = threading.Event()
    try:
        server = make_server(catalog, store)
        client = RecClient(server.address, timeout_s=5)

        def writer() -> None:
            item = 0
            with RecClient(server.address, timeout_s=5) as own:
                while not stop_writer.is_set():
                    item = item % 2000 + 1
                    try:
                        own.record("writer", [item])
                        acked.append(item)
                        writer_codes["OK"] = writer_codes.get("OK", 0) + 1
                    except grpc.RpcError as exc:
                        writer_codes[exc.code().name] = writer_codes.get(exc.code().name, 0) + 1
                    time.sleep(0.005)

        assert client.record("alice", [1, 2, 3]) == 3
        thread = threading.Thread(target=writer)
        thread.start()
        time.sleep(0.3)
        before = client.recommend("alice", k=2, exclude_history=True)
        assert [i.item_id for i in before.items] == [4, 5] and not before.fallback_reason

        redis_proc.stop()  # --- outage ---
        inline = client.recommend("alice", history=[1, 2], k=2, exclude_history=True)
        assert [i.item_id for i in inline.items] == [3, 4]
        try:
            client.recommend("alice", k=2)
            raise AssertionError("stored-history request must fail while Redis is down")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert exc.details() == "history store unavailable"  # no Redis host/port leaks to clients
        assert _status(lambda: client.record("alice", [9])) == grpc.StatusCode.UNAVAILABLE
        assert _status(lambda: client.history("alice")) == grpc.StatusCode.UNAVAILABLE
        assert client.health() == "SERVING"
        time.sleep(0.3)

        redis_proc.start()  # --- recovery (same port, data reloaded from the append-only file) ---
        deadline = time.monotonic() + 10
        while _status(lambda: client.recommend("alice", k=2)) != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "server did not recover after Redis came back"
            time.sleep(0.05)
        time.sleep(0.3)
        stop_writer.set()
        thread.join(10)

        assert client.history("alice") == [1, 2, 3]  # the rejected record of 9 was not stored
        final = client.history("writer")
        assert writer_codes.get("UNAVAILABLE", 0) > 0, writer_codes
        assert writer_codes.get("OK", 0) > 0 and set(writer_codes) <= {"OK", "UNAVAILABLE"}, writer_codes
        assert _is_subsequence(acked, final), "an acknowledged RecordInteractions was lost"
        client.close()
    finally:
        stop_writer.set()
        store.close()
