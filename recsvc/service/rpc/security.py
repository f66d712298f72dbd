"""Transport security (TLS credentials) and the API-key server interceptor.

The API key travels in the ``x-api-key`` metadata entry; a missing or wrong key is answered with
UNAUTHENTICATED before the handler runs. Health checks and server reflection are exempt: load balancers need
no key, and reflection only describes the public wire schema (protos/), never data.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from recsvc.errors import UserError
from recsvc.service.observability.metrics import ServiceMetrics

API_KEY_HEADER = "x-api-key"
API_KEY_ENV = "RECSVC_API_KEY"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1.ServerReflection/", "/grpc.reflection.v1alpha.ServerReflection/")


def api_key_from(value: str | None) -> str | None:
    """The explicit value, else ``$RECSVC_API_KEY``, else None (no key required / sent)."""
    key = value if value is not None else os.environ.get(API_KEY_ENV)
    return key or None


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if not data.strip():
        raise UserError(f"{what} {path} is empty")
    return data


def server_credentials(cert_path: str | Path, key_path: str | Path) -> grpc.ServerCredentials:
    """TLS server credentials from PEM files (certificate chain + private key)."""
    return grpc.ssl_server_credentials([(_read(key_path, "TLS key"), _read(cert_path, "TLS certificate"))])


def channel_credentials(ca_path: str | Path | None) -> grpc.ChannelCredentials:
    """TLS client credentials trusting ``ca_path`` (None: the system roots)."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_path, "TLS CA") if ca_path else None)


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED."""

    def deny(_request, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Requires ``x-api-key: <key>`` on every RPC except the exempt method prefixes (health, reflection)."""

    def __init__(
        self,
        api_key: str,
        *,
        exempt_prefixes: Sequence[str] = (HEALTH_PREFIX, *REFLECTION_PREFIXES),
        metrics: ServiceMetrics | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must be non-empty")
        self._key = api_key.encode()
        self._exempt = tuple(exempt_prefixes)
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(self._exempt):
            return handler
        given = next(
            (value for key, value in handler_call_details.invocation_metadata or () if key == API_KEY_HEADER),
            None,
        )
        if given is None:
            return self._deny(handler, method, "missing API key (metadata 'x-api-key')")
        given_bytes = given if isinstance(given, bytes) else str(given).encode()
        if not hmac.compare_digest(given_bytes, self._key):
            return self._deny(handler, method, "invalid API key")
        return handler

    def _deny(self, handler: grpc.RpcMethodHandler, method: str, message: str) -> grpc.RpcMethodHandler:
        if self._metrics is not None:
            self._metrics.errors.labels(method.rsplit("/", 1)[-1], "UNAUTHENTICATED").inc()
        return _denying_handler(handler, message)
