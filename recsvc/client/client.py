"""A small synchronous Python client for the recommendation service.

Several servers (e.g. replicas, or ``recsvc serve --processes N`` on several hosts): pass a comma-separated
list of ``host:port`` (IP literals, see :func:`channel_target`) or any gRPC target URI (``ipv4:a:p,b:p``,
``dns:///name:port``); every channel uses :data:`SERVICE_CONFIG`: ``round_robin`` over the resolved addresses
and up to 4 attempts of a Recommend / GetHistory / health check that fails with UNAVAILABLE (a server stopped,
draining or unreachable) or CANCELLED by a server shutting down (RecordInteractions is not retried: it is not
idempotent).

Items are named by number (the split's item ids) or by key (the team's own ids, when the server's bundle has
them): ``recommend(history_keys=..., exclude_keys=...)``, ``record(item_keys=...)``; responses carry both.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.gen import recommender_pb2_grpc as pb_grpc
from recsvc.service.rpc.security import API_KEY_HEADER, channel_credentials

# The channel's service config (gRPC option "grpc.service_config", with "grpc.enable_retries" 1): any gRPC
# client of the service can use the same JSON (deploy/README.md, "Several servers").
SERVICE_CONFIG: dict[str, Any] = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            # idempotent calls only: RecordInteractions appends, and an UNAVAILABLE reply (e.g. "history store
            # unavailable") does not prove that nothing was stored; it still gets gRPC's transparent retry of
            # calls that never reached a server
            "name": [
                {"service": "recsvc.v1.Recommender", "method": "Recommend"},
                {"service": "recsvc.v1.Recommender", "method": "GetHistory"},
                {"service": "grpc.health.v1.Health", "method": "Check"},
            ],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                # CANCELLED too: grpc-core's server answers a call that races its shutdown (a draining
                # replica) with CANCELLED; a call the client itself cancels is never retried
                "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
            },
        }
    ],
}
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
]


URI_SCHEMES = ("ipv4:", "ipv6:", "dns:", "unix:", "unix-abstract:", "vsock:")


def channel_target(target: str) -> str:
    """``host:port`` or a gRPC URI (``ipv4:``, ``ipv6:``, ``dns:``, ``unix:``) unchanged; a comma-separated list
    of IP ``host:port`` (``127.0.0.1:5001,127.0.0.1:5002``, IPv6 as ``[::1]:5001``) becomes ``ipv4:...`` /
    ``ipv6:...``, which round_robin spreads RPCs over. ValueError for a list with host names (use one
    ``dns:///name:port`` whose name resolves to every server) or mixed families."""
    if "," not in target or target.startswith(URI_SCHEMES):
        return target
    parts = [part.strip() for part in target.split(",") if part.strip()]
    families = set()
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"expected host:port in {target!r}, got {part!r}")
        try:
            families.add(ipaddress.ip_address(host.strip("[]")).version)
        except ValueError:
            raise ValueError(
                f"a list of targets takes IP addresses (got {host!r}); for host names use one dns:///NAME:PORT "
                "whose name resolves to every server"
            ) from None
    if len(families) != 1:
        raise ValueError(f"mixed IPv4 and IPv6 addresses in {target!r}")
    return f"ipv{families.pop()}:" + ",".join(parts)

MODE_NAMES: dict[str, int] = {
    "default": pb.UNSPECIFIED,
    "strict": pb.STRICT_SPECULATIVE,
    "relaxed": pb.RELAXED_SPECULATIVE,
    "plain": pb.PLAIN,
}
_MODE_LABEL = {**{wire: name for name, wire in MODE_NAMES.items()}, pb.POPULARITY: "popularity",
               pb.SAMPLING: "sampling"}


class RecClient:
    """Wraps a channel to ``target`` (``host:port``, a comma-separated list of them or a gRPC URI, see
    :func:`channel_target`); gRPC errors surface as :class:`grpc.RpcError`. Round-robin over several
    servers, UNAVAILABLE retried (:data:`SERVICE_CONFIG`)."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tls_ca: str | Path | None = None,
        tls: bool = False,
        server_name: str | None = None,
        timeout_s: float = 10.0,
        max_message_bytes: int = 4 << 20,
    ) -> None:
        target = channel_target(target)
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", max_message_bytes), *CHANNEL_OPTIONS]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls_ca or tls:
            self.channel = grpc.secure_channel(target, channel_credentials(tls_ca), options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.RecommenderStub(self.channel)
        self.timeout_s = timeout_s
        self._metadata = ((API_KEY_HEADER, api_key),) if api_key else ()

    def recommend(
        self,
        user_id: str,
        *,
        history: Sequence[int] = (),
        k: int | None = None,
        mode: str | int = "default",
        exclude_items: Sequence[int] = (),
        exclude_history: bool | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        rules: pb.Rules | None = None,
        timeout_s: float | None = None,
        history_keys: Sequence[str] = (),
        exclude_keys: Sequence[str] = (),
    ) -> pb.RecommendResponse:
        """``rules``: e.g. ``rules_message(max_per={"brand": 2}, allow={"category": ["skin"]})``.
        ``exclude_history``: True / False leaves the history's items out / in; None: as the server is configured.
        ``history_keys`` / ``exclude_keys``: the history / exclusions as item keys (instead of numbers); each
        returned item carries its ``key`` when the catalog has one."""
        request = pb.RecommendRequest(
            user_id=user_id,
            history=list(history),
            mode=MODE_NAMES[mode] if isinstance(mode, str) else mode,
            exclude_items=list(exclude_items),
            history_keys=list(history_keys),
            exclude_keys=list(exclude_keys),
        )
        if exclude_history is not None:
            request.exclude_history = exclude_history
        if k is not None:
            request.k = k
        if temperature is not None:
            request.temperature = temperature
        if seed is not None:
            request.seed = seed
        if rules is not None:
            request.rules.CopyFrom(rules)
        return self.stub.Recommend(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)

    def record(self, user_id: str, item_ids: Sequence[int] = (), *, item_keys: Sequence[str] = (),
               timeout_s: float | None = None) -> int:
        """Appends interactions (as numbers, or as ``item_keys``); returns the stored history length
        (acknowledged = stored)."""
        request = pb.RecordInteractionsRequest(user_id=user_id, item_ids=list(item_ids), item_keys=list(item_keys))
        reply = self.stub.RecordInteractions(
            request, timeout=timeout_s or self.timeout_s, metadata=self._metadata
        )
        return int(reply.history_length)

    def history(self, user_id: str, *, timeout_s: float | None = None) -> list[int]:
        return list(self.get_history(user_id, timeout_s=timeout_s).item_ids)

    def get_history(self, user_id: str, *, timeout_s: float | None = None) -> pb.GetHistoryResponse:
        """The stored history's reply: ``item_ids`` and, when the catalog has keys, ``item_keys`` (one per item,
        "" for an item without one)."""
        request = pb.GetHistoryRequest(user_id=user_id)
        return self.stub.GetHistory(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """``SERVING`` / ``NOT_SERVING`` / ... of ``service`` ("" = the whole server)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s or self.timeout_s
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RecClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rules_message(
    max_per: Mapping[str, int] | Sequence[tuple[str, int]] = (),
    allow: Mapping[str, Sequence[str]] | Sequence[tuple[str, Sequence[str]]] = (),
    deny: Mapping[str, Sequence[str]] | Sequence[tuple[str, Sequence[str]]] = (),
    boosts: Sequence[tuple[str, str, float]] = (),
) -> pb.Rules:
    """``rules_message(max_per={"brand": 2}, allow={"category": ["skin", "makeup"]},
    boosts=[("brand", "olay", 0.5)])`` -> the ``Rules`` message of a RecommendRequest (pairs instead of a
    mapping give two filters on one attribute: both apply)."""

    def pairs(x):
        return list(x.items()) if isinstance(x, Mapping) else list(x)

    return pb.Rules(
        max_per=[pb.MaxPer(attribute=a, m=m) for a, m in pairs(max_per)],
        allow=[pb.ValueFilter(attribute=a, values=list(v)) for a, v in pairs(allow)],
        deny=[pb.ValueFilter(attribute=a, values=list(v)) for a, v in pairs(deny)],
        boosts=[pb.Boost(attribute=a, value=v, weight=w) for a, v, w in boosts],
    )


def response_to_dict(response: pb.RecommendResponse) -> dict[str, Any]:
    """JSON-friendly view (ints stay ints, unlike protobuf's JSON mapping of int64)."""
    stats = response.stats
    return {
        "items": [
            {"item_id": item.item_id, **({"key": item.key} if item.key else {}), "score": round(item.score, 6),
             "semantic_id": list(item.semantic_id)}
            for item in response.items
        ],
        "stats": {
            "target_forward_calls": stats.target_forward_calls,
            "draft_forward_calls": stats.draft_forward_calls,
            "accepted_steps": stats.accepted_steps,
            "server_ms": round(stats.server_ms, 3),
            "batch_size": stats.batch_size,
            "mode": _MODE_LABEL.get(stats.mode, str(stats.mode)),
            "requested_mode": _MODE_LABEL.get(stats.requested_mode, str(stats.requested_mode)),
            "mode_fallback_reason": stats.mode_fallback_reason,
            "beam_width": stats.beam_width,
            "draft_beams": stats.draft_beams,
            "gamma": stats.gamma,
        },
        "fallback_reason": response.fallback_reason,
    }
