"""Sticky routing by user id over several servers, for deployments that keep per-user state in process.

:class:`StickyClient` holds one :class:`RecClient` (one channel) per server and a consistent-hash ring
(:class:`recsvc.client.routing.HashRing`) over them: every call for a user goes to that user's server.
Recommend and GetHistory answered UNAVAILABLE there (server down, draining, starting) go to the next server on
the ring; RecordInteractions is not moved (not idempotent: an UNAVAILABLE write may have been stored), which
matches the round_robin retry policy of :data:`recsvc.client.client.SERVICE_CONFIG`.

    with StickyClient("10.0.0.1:50051,10.0.0.2:50051") as client:
        client.record("alice", [1, 2])
        client.recommend("alice", k=10)   # same server as the record
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from recsvc.client.client import RecClient

from .routing import HashRing

T = TypeVar("T")


def split_targets(targets: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> distinct ``host:port`` strings (host names allowed: each server
    gets its own channel). ValueError otherwise."""
    parts = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    for part in parts:
        _, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"expected host:port, got {part!r}")
    if not parts or len(set(parts)) != len(parts):
        raise ValueError(f"expected distinct host:port targets, got {targets!r}")
    return parts


class StickyClient:
    """``RecClient``'s calls, each routed to its user's server; ``client_options`` go to every RecClient."""

    def __init__(self, targets: str | Sequence[str], *, vnodes: int = 64, **client_options: Any) -> None:
        self.targets = split_targets(targets)
        self.ring = HashRing(self.targets, vnodes=vnodes)
        self.clients = {target: RecClient(target, **client_options) for target in self.targets}

    def target_of(self, user_id: str) -> str:
        return self.ring.owner(user_id)

    def client_for(self, user_id: str) -> RecClient:
        return self.clients[self.ring.owner(user_id)]

    def recommend(self, user_id: str, **kwargs: Any):
        return self._with_failover(user_id, lambda c: c.recommend(user_id, **kwargs))

    def history(self, user_id: str, **kwargs: Any) -> list[int]:
        return self._with_failover(user_id, lambda c: c.history(user_id, **kwargs))

    def get_history(self, user_id: str, **kwargs: Any):
        return self._with_failover(user_id, lambda c: c.get_history(user_id, **kwargs))

    def record(self, user_id: str, item_ids: Sequence[int] = (), **kwargs: Any) -> int:
        return self.client_for(user_id).record(user_id, item_ids, **kwargs)

    def health(self, service: str = "", **kwargs: Any) -> dict[str, str]:
        """``{target: status}`` for every server (an unreachable one: ``"UNAVAILABLE"``)."""
        out = {}
        for target, client in self.clients.items():
            try:
                out[target] = client.health(service, **kwargs)
            except grpc.RpcError as exc:
                out[target] = exc.code().name
        return out

    def _with_failover(self, user_id: str, call: Callable[[RecClient], T]) -> T:
        order = self.ring.order(user_id)
        for i, target in enumerate(order):
            try:
                return call(self.clients[target])
            except grpc.RpcError as exc:
                if i == len(order) - 1 or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def __enter__(self) -> StickyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
