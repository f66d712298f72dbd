"""Health-based removal of a replica with gRPC client-side health checking: the documented service config plus
``"healthCheckConfig": {"serviceName": "recsvc.v1.Recommender"}`` (deploy/README.md, "Several servers") makes
round_robin skip a replica that listens but is not SERVING (starting: engine loading / calibrating; draining),
and take it in once it serves. Real servers on loopback, a real gRPC channel."""

from __future__ import annotations

import json
import threading

import grpc

from recsvc.client.client import SERVICE_CONFIG
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.gen import recommender_pb2_grpc as pb_grpc
from recsvc.service.rpc.server import RecServer, ServerConfig

HEALTH_CHECKED = {**SERVICE_CONFIG, "healthCheckConfig": {"serviceName": "recsvc.v1.Recommender"}}


def _channel(*servers) -> grpc.Channel:
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return grpc.insecure_channel(
        target, options=[("grpc.service_config", json.dumps(HEALTH_CHECKED)), ("grpc.enable_retries", 1)]
    )


def _answered(server) -> float:
    return server.metrics.registry.get_sample_value(
        "recsvc_requests_total", {"method": "Recommend", "code": "OK"}
    ) or 0.0


def _send(stub, n: int) -> list[str]:
    codes = []
    for i in range(n):
        try:
            stub.Recommend(pb.RecommendRequest(user_id=f"u{i}", history=[1], k=2), timeout=5)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
    return codes


def test_a_starting_replica_gets_no_calls_until_it_serves(catalog, make_server):
    serving = make_server(catalog)
    starting = RecServer(None, None, ServerConfig(max_wait_ms=2.0)).start()  # listens, NOT_SERVING
    try:
        with _channel(serving, starting) as channel:
            stub = pb_grpc.RecommenderStub(channel)
            assert set(_send(stub, 40)) == {"OK"}  # without the health check, half would be UNAVAILABLE
            assert _answered(serving) == 40
            starting.attach(catalog)  # SERVING: the health watch brings it into the rotation
            codes = []
            for _ in range(50):
                codes += _send(stub, 10)
                if _answered(starting) > 0:
                    break
            assert set(codes) == {"OK"} and _answered(starting) > 0
    finally:
        starting.stop(grace_s=0.5)


def test_a_draining_replica_is_removed_without_failed_calls(catalog, make_server):
    first, second = make_server(catalog), make_server(catalog)
    failures: list[str] = []
    sent = threading.Semaphore(0)
    with _channel(first, second) as channel:
        stub = pb_grpc.RecommenderStub(channel)

        def send() -> None:
            for _ in range(60):
                failures.extend(code for code in _send(stub, 1) if code != "OK")
                sent.release()

        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in range(60):  # a quarter answered: drain one replica while calls keep flowing
            sent.acquire()
        first.stop(grace_s=1.0)
        for t in threads:
            t.join(30)
    assert not failures, failures[:5]
    assert _answered(first) > 0 and _answered(first) + _answered(second) == 240


def test_an_unavailable_answered_by_a_live_server_is_retried_on_another(catalog, make_server):
    """Without health checking (RecClient's default config), a starting replica answers UNAVAILABLE itself;
    the status goes out trailers-only (context.abort), so the retry policy replays the call on the next replica:
    no call fails. (With set_code + return it was committed after the headers and never retried.)"""
    serving = make_server(catalog)
    starting = RecServer(None, None, ServerConfig(max_wait_ms=2.0)).start()  # listens, NOT_SERVING
    try:
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in (serving, starting))
        options = [("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1)]
        with grpc.insecure_channel(target, options=options) as channel:
            stub = pb_grpc.RecommenderStub(channel)
            assert set(_send(stub, 30)) == {"OK"}
        assert _answered(serving) == 30
        refused = starting.metrics.registry.get_sample_value(
            "recsvc_requests_total", {"method": "Recommend", "code": "UNAVAILABLE"}) or 0.0
        assert refused > 0  # round_robin did send calls there; each was replayed on the serving replica
    finally:
        starting.stop(grace_s=0.5)
