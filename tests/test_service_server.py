"""The gRPC server end to end on 127.0.0.1: round trips, validation, batching, deadlines, drain, health."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Sequence

import grpc
import pytest
from service_helpers import status_of, wait_until

from recsvc.client.client import RecClient
from recsvc.recommender.answer import NO_DECODING_REASON, NO_HISTORY_REASON, Answering
from recsvc.recommender.api import RecQuery, RecResult, WithoutModel
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.stores import open_store


class DelayedRecommender(WithoutModel, Answering):
    """Wraps a recommender: each engine call takes ``delay_s`` longer (a slow model); records the queries."""

    def __init__(self, inner, delay_s: float, poison_item: int | None = None) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.poison_item = poison_item
        self.max_k, self.max_history = inner.max_k, inner.max_history
        self.seen: list[RecQuery] = []
        self.calls = 0

    def known_item(self, item_id: int) -> bool:
        return self.inner.known_item(item_id)

    def semantic_id(self, item_id: int) -> list[str]:
        return self.inner.semantic_id(item_id)

    def popular_items(self, k: int, exclude: Sequence[int] = ()) -> list[int]:
        return self.inner.popular_items(k, exclude)

    def recommend(self, queries: Sequence[RecQuery]) -> list[RecResult]:
        self.calls += 1
        self.seen.extend(queries)
        time.sleep(self.delay_s)
        if self.poison_item is not None and any(self.poison_item in q.history for q in queries):
            raise ValueError("engine blew up")
        return self.inner.recommend(queries)




def test_round_trips_and_fallback(catalog, make_server):
    server = make_server(catalog)
    with RecClient(server.address) as client:
        cold = client.recommend("alice", k=3)
        assert [i.item_id for i in cold.items] == [1, 2, 3]
        assert cold.fallback_reason == NO_HISTORY_REASON
        assert cold.stats.batch_size == 0 and cold.stats.mode == pb.POPULARITY  # no engine ran
        assert client.record("alice", [1, 2]) == 2
        assert client.record("alice", [5]) == 3
        assert client.history("alice") == [1, 2, 5]
        assert client.history("bob") == []
        warm = client.recommend("alice", k=4, exclude_history=True, exclude_items=[3], mode="plain")
        assert [i.item_id for i in warm.items] == [4, 6, 7, 8]
        assert warm.fallback_reason == "" and warm.stats.batch_size >= 1
        assert warm.stats.requested_mode == pb.PLAIN and warm.stats.server_ms > 0
        assert warm.stats.mode == pb.POPULARITY and warm.stats.mode_fallback_reason == NO_DECODING_REASON
        assert warm.stats.beam_width == 0  # a popularity table decodes nothing
        assert list(warm.items[0].semantic_id) == catalog.semantic_id(4)
        assert warm.items[0].score == pytest.approx(catalog.score(4), rel=1e-5)
        inline = client.recommend(
            "alice", history=[4, 6], exclude_history=True, k=2
        )  # replaces stored history
        assert [i.item_id for i in inline.items] == [1, 2]
        default_k = client.recommend("carol", history=[9])
        assert len(default_k.items) == 10 and default_k.fallback_reason == ""


def test_stored_history_through_redis(catalog, make_server, redis_server):
    store = open_store(redis_server.url, max_len=200)
    try:
        server = make_server(catalog, store)
        with RecClient(server.address) as client:
            assert client.record("r", [1, 2, 3]) == 3
            assert client.history("r") == [1, 2, 3]
            response = client.recommend("r", k=2, exclude_history=True)
            assert [i.item_id for i in response.items] == [4, 5] and response.fallback_reason == ""
    finally:
        store.close()


BAD_RECOMMEND = [
    (dict(user_id=""), "user_id is empty"),
    (dict(user_id="x" * 129), "user_id has 129 characters; the limit is 128"),
    (dict(user_id="a\nb"), "control characters"),
    (dict(k=0), "k must be between 1 and 50 (got 0)"),
    (dict(k=51), "k must be between 1 and 50 (got 51)"),
    (dict(k=-3), "(got -3)"),
    (dict(history=list(range(1, 202))), "history has 201 items; the limit is 200"),
    (
        dict(history=[1, 5000, 0, -7, 2001, 9999, 10**12]),
        "unknown item ids in history: 5000, 0, -7, 2001, 9999 and 1 more",
    ),
    (dict(temperature=0.0), "temperature must be between 0.05 and 10.0 (got 0)"),
    (dict(temperature=1e-45), "temperature must be between 0.05 and 10.0 (got 1.4013e-45)"),
    (dict(temperature=1e-38), "temperature must be between 0.05 and 10.0"),
    (dict(temperature=1e-20), "temperature must be between 0.05 and 10.0"),
    (dict(temperature=0.04), "temperature must be between 0.05 and 10.0"),
    (dict(temperature=10.5), "temperature must be between 0.05 and 10.0 (got 10.5)"),
    (dict(temperature=1e-20, mode=pb.RELAXED_SPECULATIVE, k=5), "temperature must be between"),
    (dict(k=2**31), "k must be between 1 and 50 (got 2147483648)"),
    (dict(k=2**32 + 5), "(got 4294967301)"),
    (dict(k=-(2**40)), "(got -1099511627776)"),
    (dict(mode=pb.POPULARITY), "unknown mode 4 (expected one of UNSPECIFIED, STRICT_SPECULATIVE"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "(got nan)"),
    (dict(temperature=float("inf")), "(got inf)"),
    (dict(mode=17), "unknown mode 17"),
    (dict(exclude_items=list(range(1001))), "exclude_items has 1001 items; the limit is 1000"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_RECOMMEND)
def test_bad_recommend_requests_are_invalid_argument(catalog, make_server, fields, message):
    server = make_server(catalog)
    request = pb.RecommendRequest(**{"user_id": "u", **fields})
    with RecClient(server.address) as client:
        code, details = status_of(lambda: client.stub.Recommend(request, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in details


def test_bad_record_and_history_requests(catalog, make_server):
    server = make_server(catalog)
    with RecClient(server.address) as client:
        assert status_of(lambda: client.record("u", [])) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "item_ids is empty",
        )
        code, details = status_of(lambda: client.record("u", [1, 99999]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "unknown item ids in item_ids: 99999"
        assert status_of(lambda: client.history(""))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert status_of(lambda: client.record("u", list(range(1, 202))))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert client.history("u") == []  # nothing was stored by the rejected calls


def test_concurrent_clients_are_batched(catalog, make_server):
    server = make_server(catalog, max_batch=16, max_wait_ms=100)
    barrier = threading.Barrier(12)
    sizes: list[int] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with RecClient(server.address) as client:
                client.health()  # connect before the barrier
                barrier.wait(timeout=10)
                response = client.recommend(f"user{i}", history=[i + 1], k=5, exclude_history=True)
                assert i + 1 not in [item.item_id for item in response.items]
                sizes.append(response.stats.batch_size)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(sizes) == 12 and max(sizes) > 1, sizes
    assert max(sizes) <= 16


def test_deadline_expired_while_queued_is_not_computed(catalog, make_server):
    slow = DelayedRecommender(catalog, delay_s=0.6)
    server = make_server(slow, max_batch=1, warmup=False)
    with RecClient(server.address) as client:
        first = threading.Thread(target=lambda: client.recommend("a", history=[1], k=1, timeout_s=10))
        first.start()
        wait_until(lambda: slow.calls >= 1)  # the engine is now busy with the first query
        code, _ = status_of(lambda: client.recommend("b", history=[777], k=1, timeout_s=0.2))
        first.join()
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.1)
        assert all(777 not in q.history for q in slow.seen), "an expired query reached the engine"
        assert client.recommend("c", history=[2], k=1).items  # still serving


def test_engine_failure_is_internal_generic_and_isolated(catalog, make_server):
    poisoned = DelayedRecommender(catalog, delay_s=0.0, poison_item=13)
    server = make_server(poisoned, max_batch=8, max_wait_ms=100, warmup=False)
    results: dict[str, tuple] = {}

    def call(user: str, history: list[int]) -> None:
        with RecClient(server.address) as client:
            results[user] = status_of(lambda: client.recommend(user, history=history, k=2))

    threads = [threading.Thread(target=call, args=(f"u{i}", [13] if i == 0 else [i + 20])) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results["u0"] == (grpc.StatusCode.INTERNAL, "internal error")
    assert all(results[f"u{i}"][0] == grpc.StatusCode.OK for i in range(1, 4)), results
    with RecClient(server.address) as client:
        assert client.recommend("after", history=[3], k=1).items


def test_drain_finishes_in_flight_and_refuses_new(catalog, make_server):
    slow = DelayedRecommender(catalog, delay_s=0.8)
    server = make_server(slow, warmup=False)
    outcome: dict[str, object] = {}

    def in_flight() -> None:
        with RecClient(server.address) as client:
            outcome["first"] = client.recommend("a", history=[1], k=3, timeout_s=10)

    thread = threading.Thread(target=in_flight)
    thread.start()
    wait_until(lambda: slow.calls >= 1)  # the request is inside the engine
    stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 5.0})
    stopper.start()
    with RecClient(server.address) as client:  # soon new calls are refused (one may slip in before stop;
        codes = []  # it is then served within the grace period, after the slow in-flight one: a long deadline)
        while not codes or codes[-1] == grpc.StatusCode.OK:
            codes.append(status_of(lambda: client.recommend("late", k=1, timeout_s=10))[0])
            assert len(codes) < 100
    # grpc-core answers calls racing the shutdown with CANCELLED, later ones with UNAVAILABLE
    assert codes[-1] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), codes
    thread.join(10)
    stopper.join(10)
    assert [i.item_id for i in outcome["first"].items] == [1, 2, 3]
    assert server.wait(0)


def test_health_reflection_and_metrics(catalog, make_server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    server = make_server(catalog, metrics_port=0)
    with RecClient(server.address) as client:
        assert client.health() == "SERVING"
        assert client.health("recsvc.v1.Recommender") == "SERVING"
        client.recommend("m", history=[1], k=2)
        status_of(lambda: client.recommend("m", k=0))
        db = ProtoReflectionDescriptorDatabase(client.channel)
        assert "recsvc.v1.Recommender" in db.get_services()
        assert "grpc.health.v1.Health" in db.get_services()
        assert db.FindFileContainingSymbol("recsvc.v1.RecommendRequest").name == "recsvc/v1/recommender.proto"
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    )
    assert 'recsvc_request_latency_seconds_count{method="Recommend"} 2.0' in body
    assert 'recsvc_errors_total{code="INVALID_ARGUMENT",method="Recommend"} 1.0' in body
    assert "recsvc_batch_size_count" in body and "recsvc_target_forward_calls_total" in body
    assert "recsvc_accepted_steps_total" in body


class NoRelaxedRecommender(DelayedRecommender):
    """An engine build without relaxed decoding (raises NotImplementedError, as the bundle engine does)."""

    def recommend(self, queries: Sequence[RecQuery]) -> list[RecResult]:
        if any(q.mode == "relaxed" for q in queries):
            raise NotImplementedError("decoding mode 'relaxed'")
        return super().recommend(queries)


def test_mode_the_engine_lacks_is_unimplemented(catalog, make_server):
    server = make_server(NoRelaxedRecommender(catalog, delay_s=0.0), default_mode="plain")
    with RecClient(server.address) as client:
        code, details = status_of(lambda: client.recommend("u", history=[1], mode="relaxed", temperature=0.7))
        assert code == grpc.StatusCode.UNIMPLEMENTED
        assert details == "not supported by this engine: decoding mode 'relaxed'"
        assert client.recommend("u", history=[1]).stats.requested_mode == pb.PLAIN  # the server's default
