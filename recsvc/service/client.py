"""A small synchronous Python client for the recommendation service."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .gen import recommender_pb2 as pb
from .gen import recommender_pb2_grpc as pb_grpc
from .security import API_KEY_HEADER, channel_credentials

MODE_NAMES: dict[str, int] = {
    "default": pb.UNSPECIFIED,
    "strict": pb.STRICT_SPECULATIVE,
    "relaxed": pb.RELAXED_SPECULATIVE,
    "plain": pb.PLAIN,
}
_MODE_LABEL = {**{wire: name for name, wire in MODE_NAMES.items()}, pb.POPULARITY: "popularity"}


class RecClient:
    """Wraps a channel to ``target`` (``host:port``); gRPC errors surface as :class:`grpc.RpcError`."""

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
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", max_message_bytes)]
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
        exclude_history: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
        timeout_s: float | None = None,
    ) -> pb.RecommendResponse:
        request = pb.RecommendRequest(
            user_id=user_id,
            history=list(history),
            mode=MODE_NAMES[mode] if isinstance(mode, str) else mode,
            exclude_items=list(exclude_items),
            exclude_history=exclude_history,
        )
        if k is not None:
            request.k = k
        if temperature is not None:
            request.temperature = temperature
        if seed is not None:
            request.seed = seed
        return self.stub.Recommend(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)

    def record(self, user_id: str, item_ids: Sequence[int], *, timeout_s: float | None = None) -> int:
        """Appends interactions; returns the stored history length (acknowledged = stored)."""
        request = pb.RecordInteractionsRequest(user_id=user_id, item_ids=list(item_ids))
        reply = self.stub.RecordInteractions(
            request, timeout=timeout_s or self.timeout_s, metadata=self._metadata
        )
        return int(reply.history_length)

    def history(self, user_id: str, *, timeout_s: float | None = None) -> list[int]:
        request = pb.GetHistoryRequest(user_id=user_id)
        reply = self.stub.GetHistory(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        return list(reply.item_ids)

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


def response_to_dict(response: pb.RecommendResponse) -> dict[str, Any]:
    """JSON-friendly view (ints stay ints, unlike protobuf's JSON mapping of int64)."""
    stats = response.stats
    return {
        "items": [
            {"item_id": item.item_id, "score": round(item.score, 6), "semantic_id": list(item.semantic_id)}
            for item in response.items
        ],
        "stats": {
            "target_forward_calls": stats.target_forward_calls,
            "draft_forward_calls": stats.draft_forward_calls,
            "accepted_steps": stats.accepted_steps,
            "server_ms": round(stats.server_ms, 3),
            "batch_size": stats.batch_size,
            "mode": _MODE_LABEL.get(stats.mode, str(stats.mode)),
        },
        "fallback_reason": response.fallback_reason,
    }
