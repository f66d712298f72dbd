"""Serving hardening against a real gRPC server on localhost (and a real redis-server where the store matters):
cancellation / deadlines, temperature and k limits, short-result reasons, readiness while starting, history
store health, generic outage messages, reflection v1 without the API key, process metrics."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from service_helpers import Records, status_of, wait_until
from test_service_server import DelayedRecommender

from recsvc.client.client import RecClient
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.rpc.server import STORE_HEALTH_NAME, RecServer, ServerConfig
from recsvc.service.startup.popularity import PopularityRecommender
from recsvc.service.stores import open_store


@pytest.fixture
def records():
    handler = Records()
    logger = logging.getLogger("recsvc")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old_level)




def _sample(server, name: str, labels: dict | None = None) -> float:
    return server.metrics.registry.get_sample_value(name, labels or {}) or 0.0


# --- 1. cancelled and expired calls -----------------------------------------------------------------------------


def test_cancelled_and_expired_calls_are_counted_as_such_and_never_computed(catalog, make_server, records):
    slow = DelayedRecommender(catalog, delay_s=0.4)
    server = make_server(slow, max_batch=1, warmup=False)
    with RecClient(server.address) as client:
        client.health()
        blocker = client.stub.Recommend.future(pb.RecommendRequest(user_id="b", history=[1], k=2), timeout=10)
        wait_until(lambda: slow.calls >= 1)  # the engine is busy: what follows queues up
        expired = [
            client.stub.Recommend.future(pb.RecommendRequest(user_id="e", history=[8], k=3), timeout=0.001)
            for _ in range(12)
        ]
        cancelled = [
            client.stub.Recommend.future(pb.RecommendRequest(user_id="c", history=[7], k=3), timeout=10)
            for _ in range(20)
        ]
        time.sleep(0.03)
        for call in cancelled:
            call.cancel()
        assert blocker.result(10).items
        for call in expired:
            assert call.exception(10).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for call in cancelled:
            assert call.cancelled()
        # the queue drains: every queued cancelled / expired query is dropped before the engine call
        wait_until(lambda: _sample(server, "recsvc_queue_depth") == 0)
        after = client.recommend("d", history=[2], k=2)  # goes through the batcher after the dropped ones
        assert after.items
    assert not [q for q in slow.seen if list(q.history) in ([7], [8])], "cancelled / expired work was computed"
    assert _sample(server, "recsvc_errors_total", {"method": "Recommend", "code": "INTERNAL"}) == 0
    assert _sample(server, "recsvc_errors_total", {"method": "Recommend", "code": "UNKNOWN"}) == 0
    cancelled_n = _sample(server, "recsvc_errors_total", {"method": "Recommend", "code": "CANCELLED"})
    assert cancelled_n >= 1
    dropped = _sample(server, "recsvc_expired_in_queue_total", {"reason": "cancelled"}) + _sample(
        server, "recsvc_expired_in_queue_total", {"reason": "deadline"}
    )
    assert dropped >= cancelled_n >= 1
    assert not [r for r in records if r.getMessage().startswith("unexpected error")]
    assert not [r for r in records if r.exc_info]


# --- 2./3. temperature, short results -----------------------------------------------------------------------------


def test_extreme_temperatures_are_invalid_in_every_mode(catalog, make_server):
    server = make_server(catalog)
    with RecClient(server.address) as client:
        for temperature in (1e-45, 1e-38, 1e-20, 0.049, 10.01, 1e30):
            for mode in ("relaxed", "strict", "plain"):
                code, details = status_of(
                    lambda t=temperature, m=mode: client.recommend(
                        "u", history=[1], k=5, mode=m, temperature=t
                    )
                )
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (temperature, mode)
                assert details.startswith("temperature must be between 0.05 and 10.0 (got ")
        for temperature in (0.05, 1.0, 10.0):
            out = client.recommend("u", history=[1], k=5, mode="relaxed", temperature=temperature, seed=1)
            assert len(out.items) == 5 and out.fallback_reason == ""


class ShortRecommender(DelayedRecommender):
    """An engine that returns one item fewer than asked."""

    def recommend(self, queries):
        out = super().recommend(queries)
        for result in out:
            del result.item_ids[-1:]
            del result.scores[-1:]
        return out


def test_short_and_empty_results_say_why(make_server):
    small = PopularityRecommender({item: 100 - item for item in range(1, 21)}, max_k=50)
    server = make_server(small)
    everything = list(range(1, 21))
    with RecClient(server.address) as client:
        none_left = client.recommend("u", history=[1], k=10, exclude_items=everything)
        assert len(none_left.items) == 0
        assert none_left.fallback_reason == "no items remain after exclusions"
        assert none_left.stats.mode == pb.POPULARITY and none_left.stats.batch_size == 0
        five = client.recommend("u", history=[1], k=10, exclude_items=everything[5:])
        assert [i.item_id for i in five.items] == [1, 2, 3, 4, 5]
        assert five.fallback_reason == "only 5 items remain after exclusions"
        via_history = client.recommend(
            "u", history=everything[:17], k=10, exclude_history=True, mode="plain"
        )
        assert len(via_history.items) == 3
        assert via_history.fallback_reason == "only 3 items remain after exclusions"
        cold = client.recommend("new", k=10, exclude_items=everything[2:])
        assert [i.item_id for i in cold.items] == [1, 2]
        assert cold.fallback_reason == "no_history: popular items; only 2 items remain after exclusions"
        full = client.recommend("u", history=[1], k=10, exclude_items=everything[10:])
        assert len(full.items) == 10 and full.fallback_reason == ""
    short = make_server(ShortRecommender(small, delay_s=0.0), warmup=False)
    with RecClient(short.address) as client:
        out = client.recommend("u", history=[1], k=10)
        assert len(out.items) == 9
        assert out.fallback_reason == "the engine returned 9 of the 10 items asked for"


# --- 6. readiness while starting ------------------------------------------------------------------------------


def test_health_is_not_serving_until_the_engine_is_attached(catalog, records):
    server = RecServer(None, None, ServerConfig(max_wait_ms=2.0)).start()
    try:
        with RecClient(server.address) as client:
            assert client.health() == "NOT_SERVING"
            assert client.health("recsvc.v1.Recommender") == "NOT_SERVING"
            code, details = status_of(lambda: client.recommend("u", history=[1], k=2))
            assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "server is starting up")
            assert status_of(lambda: client.history("u"))[0] == grpc.StatusCode.UNAVAILABLE
            server.attach(catalog, bundle="test-bundle", spec="auto")
            assert client.health() == "SERVING" and client.health("recsvc.v1.Recommender") == "SERVING"
            assert client.recommend("u", history=[1], k=2).items
    finally:
        server.stop(grace_s=0.5)
    events = [r.getMessage() for r in records if r.name == "recsvc.service.rpc.server"]
    assert events.index("listening") < events.index("serving")
    serving = next(r for r in records if r.getMessage() == "serving")
    assert serving.fields["bundle"] == "test-bundle" and serving.fields["port"] == server.port
    assert {"address", "metrics_port", "default_mode", "max_batch", "spec"} <= set(serving.fields)


# --- 8./9. history store health, generic outage message -------------------------------------------------------


def test_history_store_health_follows_redis_and_hides_its_address(catalog, make_server, redis_server, records):
    store = open_store(redis_server.url, max_len=100, retries=0, socket_timeout_s=0.3, connect_timeout_s=0.2)
    try:
        server = make_server(catalog, store, store_probe_s=0.1)
        with RecClient(server.address, timeout_s=5) as client:
            assert client.health(STORE_HEALTH_NAME) == "SERVING"
            assert client.record("alice", [1, 2]) == 2
            redis_server.stop()  # --- outage ---
            wait_until(lambda: client.health(STORE_HEALTH_NAME) == "NOT_SERVING")
            assert client.health() == "SERVING" and client.health("recsvc.v1.Recommender") == "SERVING"
            inline = client.recommend("alice", history=[1, 2], k=2, exclude_history=True)
            assert [i.item_id for i in inline.items] == [3, 4]
            for call in (
                lambda: client.recommend("alice", k=2),
                lambda: client.record("alice", [3]),
                lambda: client.history("alice"),
            ):
                code, details = status_of(call)
                assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "history store unavailable")
            redis_server.start()  # --- recovery ---
            wait_until(lambda: client.health(STORE_HEALTH_NAME) == "SERVING")
            assert client.history("alice") == [1, 2]
    finally:
        store.close()
    port = str(redis_server.port)
    logged = [r for r in records if r.name == "recsvc.service.rpc.servicer" and "detail" in r.fields]
    assert logged and all(port in r.fields["detail"] for r in logged)  # the detail stays in the server log
    events = [r.getMessage() for r in records if r.name == "recsvc.service.rpc.server"]
    assert "history_store_unavailable" in events and events[-1] in ("history_store_available", "stopped")


# --- 10./11. reflection v1, no API key for health and reflection, process metrics ---------------------------------


def _reflect(channel: grpc.Channel, version: str, request) -> object:
    from grpc_reflection.v1alpha import reflection_pb2 as r

    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=r.ServerReflectionRequest.SerializeToString,
        response_deserializer=r.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([request]), timeout=5)))


def test_reflection_v1_and_v1alpha_without_api_key(catalog, make_server):
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as r

    server = make_server(catalog, api_key="k3y", metrics_port=0)
    with RecClient(server.address) as anonymous:
        assert anonymous.health() == "SERVING"
        for version in ("v1", "v1alpha"):
            listed = _reflect(anonymous.channel, version, r.ServerReflectionRequest(list_services=""))
            names = {s.name for s in listed.list_services_response.service}
            assert {
                "recsvc.v1.Recommender",
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
            } <= names
            for symbol, file_name in (
                ("recsvc.v1.RecommendRequest", "recsvc/v1/recommender.proto"),
                ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto"),
            ):
                found = _reflect(
                    anonymous.channel, version, r.ServerReflectionRequest(file_containing_symbol=symbol)
                )
                protos = [
                    descriptor_pb2.FileDescriptorProto.FromString(raw)
                    for raw in found.file_descriptor_response.file_descriptor_proto
                ]
                assert file_name in [p.name for p in protos], (version, symbol)
        assert status_of(lambda: anonymous.recommend("u", history=[1], k=1))[0] == grpc.StatusCode.UNAUTHENTICATED
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_start_time_seconds",
                 "process_open_fds"):
        assert _sample(server, name) > 0, name


def test_k_above_int32_is_reported_as_sent(catalog, make_server):
    server = make_server(catalog)
    with RecClient(server.address) as client:
        for k in (2**31, 2**32, 2**32 + 5, 2**63 - 1):
            code, details = status_of(
                lambda k=k: client.stub.Recommend(pb.RecommendRequest(user_id="u", k=k), timeout=5)
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert details == f"k must be between 1 and 50 (got {k})"


def test_concurrent_cancellations_under_load_leave_no_internal(catalog, make_server, records):
    slow = DelayedRecommender(catalog, delay_s=0.02)
    server = make_server(slow, max_batch=4)
    stop = threading.Event()

    def hammer(i: int) -> None:
        with RecClient(server.address) as client:
            while not stop.is_set():
                call = client.stub.Recommend.future(
                    pb.RecommendRequest(user_id=f"h{i}", history=[i + 1], k=3), timeout=0.002 + 0.01 * (i % 3)
                )
                if i % 2:
                    time.sleep(0.005)
                    call.cancel()
                try:
                    call.result(5)
                except grpc.RpcError:
                    pass
                except grpc.FutureCancelledError:
                    pass

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    for code in ("INTERNAL", "UNKNOWN"):
        assert _sample(server, "recsvc_errors_total", {"method": "Recommend", "code": code}) == 0
    assert not [r for r in records if r.exc_info]
