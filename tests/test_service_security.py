"""API key interceptor, TLS (self-signed certificate made with the openssl CLI) and message size limits."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import status_of

from recsvc.client.client import RecClient
from recsvc.service.gen import recommender_pb2 as pb


def test_api_key_required_except_health_and_reflection(catalog, make_server):
    server = make_server(catalog, api_key="s3cret")
    with RecClient(server.address) as anonymous:
        assert status_of(lambda: anonymous.recommend("u", k=1)) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "missing API key (metadata 'x-api-key')",
        )
        assert status_of(lambda: anonymous.record("u", [1]))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.health() == "SERVING"  # load balancers need no key
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        # reflection describes the public schema only: reachable without the key, like health
        assert "recsvc.v1.Recommender" in ProtoReflectionDescriptorDatabase(anonymous.channel).get_services()
    with RecClient(server.address, api_key="wrong") as wrong:
        assert status_of(lambda: wrong.history("u")) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
    with RecClient(server.address, api_key="s3cret") as good:
        assert good.record("u", [1]) == 1
        assert good.recommend("u", k=2).items
    assert (
        server.metrics.registry.get_sample_value(
            "recsvc_errors_total", {"method": "Recommend", "code": "UNAUTHENTICATED"}
        )
        == 1.0
    )


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip(
            "neither the openssl CLI nor a certificate library is available to make a test certificate"
        )
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls_round_trip_and_plaintext_refused(catalog, make_server, tls_files):
    cert, key = tls_files
    server = make_server(catalog, tls_cert=cert, tls_key=key, api_key="k")
    with RecClient(server.address, tls_ca=cert, api_key="k") as client:
        assert client.record("t", [1, 2]) == 2
        assert [i.item_id for i in client.recommend("t", k=2, exclude_history=True).items] == [3, 4]
        assert client.health() == "SERVING"
    with RecClient(f"localhost:{server.port}", tls_ca=cert, api_key="k") as by_name:
        assert by_name.history("t") == [1, 2]
    with RecClient(server.address, api_key="k", timeout_s=2) as plaintext:
        assert status_of(lambda: plaintext.history("t"))[0] == grpc.StatusCode.UNAVAILABLE


def test_tls_config_errors(catalog, make_server, tmp_path, tls_files):
    from recsvc.errors import UserError

    with pytest.raises(UserError, match="both a certificate and a key"):
        make_server(catalog, tls_cert=tls_files[0])
    with pytest.raises(UserError, match="cannot read TLS key"):
        make_server(catalog, tls_cert=tls_files[0], tls_key=tmp_path / "missing.pem")


def test_oversized_message_rejected_not_internal(catalog, make_server):
    server = make_server(catalog, max_message_bytes=4096)
    with RecClient(server.address) as client:
        code, _ = status_of(lambda: client.recommend("u", exclude_items=list(range(1, 3000)), k=1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.recommend("u", k=1).items  # the server is fine
        health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    small = pb.RecommendRequest(user_id="u", exclude_items=list(range(1, 500)))
    assert small.ByteSize() < 4096  # the limit leaves room for ordinary requests
