#!/usr/bin/env python
"""Container health check: exit 0 when the local recsvc answers SERVING on the gRPC health service, else 1.

    recsvc-healthcheck [SERVICE]     # SERVICE: "" (default, the whole server) or recsvc.v1.Recommender

Used by the image's HEALTHCHECK and by Kubernetes exec probes when the server itself terminates TLS (the
kubelet's native `grpc:` probe speaks plaintext). Settings come from the same environment as the server:
RECSVC_GRPC_PORT (default 50051); with RECSVC_TLS_CERT set it connects with TLS, trusting
RECSVC_HEALTHCHECK_CA (default: the served certificate chain itself, right for a self-signed certificate) and
checking the name RECSVC_HEALTHCHECK_SERVER_NAME (default: the certificate must name 127.0.0.1).
RECSVC_HEALTHCHECK_TARGET overrides the address (default 127.0.0.1:PORT); RECSVC_HEALTHCHECK_TIMEOUT_S the
deadline (default 3). Health needs no API key.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(target: str) -> grpc.Channel:
    cert = os.environ.get("RECSVC_TLS_CERT")
    if not cert:
        return grpc.insecure_channel(target)
    with open(os.environ.get("RECSVC_HEALTHCHECK_CA") or cert, "rb") as f:
        roots = f.read()
    name = os.environ.get("RECSVC_HEALTHCHECK_SERVER_NAME")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=roots), options)


def main(argv: list[str]) -> int:
    service = argv[1] if len(argv) > 1 else ""
    port = os.environ.get("RECSVC_GRPC_PORT") or "50051"
    target = os.environ.get("RECSVC_HEALTHCHECK_TARGET") or f"127.0.0.1:{port}"
    timeout_s = float(os.environ.get("RECSVC_HEALTHCHECK_TIMEOUT_S") or 3)
    try:
        channel = _channel(target)
    except OSError as exc:
        print(f"unhealthy: cannot read the TLS trust roots: {exc}")
        return 1
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}")
        return 1
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
