"""The history store interface shared by the in-process and the Redis implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class HistoryStoreUnavailable(Exception):
    """The store cannot be reached right now (the request may be retried later); maps to UNAVAILABLE."""


class HistoryStore(ABC):
    """Chronological item ids per user, trimmed to the newest ``max_len`` items.

    Implementations are thread-safe. ``append`` is acknowledged only once the items are stored; failures to
    reach the backend raise :class:`HistoryStoreUnavailable` (never another exception type).
    """

    max_len: int

    @abstractmethod
    def append(self, user_id: str, items: Sequence[int]) -> int:
        """Appends ``items`` (oldest first) to the user's history; returns the stored length afterwards."""

    @abstractmethod
    def get(self, user_id: str) -> list[int]:
        """The user's history, oldest first ([] for an unknown user)."""

    @abstractmethod
    def close(self) -> None:
        """Releases connections; the store is not used afterwards."""

    def ping(self) -> bool:
        """Whether the backend answers right now (used by health reporting)."""
        return True

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
