"""The embedded default history store: a dict of bounded deques behind one lock (lost on restart)."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

from .base import HistoryStore


class InMemoryHistoryStore(HistoryStore):
    """Thread-safe; keeps the newest ``max_len`` items per user and at most ``max_users`` users (LRU)."""

    def __init__(self, max_len: int = 200, max_users: int = 1_000_000) -> None:
        if max_len < 1 or max_users < 1:
            raise ValueError("max_len and max_users must be >= 1")
        self.max_len = max_len
        self.max_users = max_users
        self._lock = threading.Lock()
        self._data: OrderedDict[str, deque[int]] = OrderedDict()

    def append(self, user_id: str, items: Sequence[int]) -> int:
        with self._lock:
            history = self._data.get(user_id)
            if history is None:
                history = self._data[user_id] = deque(maxlen=self.max_len)
                while len(self._data) > self.max_users:
                    self._data.popitem(last=False)
            else:
                self._data.move_to_end(user_id)
            history.extend(int(item) for item in items)
            return len(history)

    def get(self, user_id: str) -> list[int]:
        with self._lock:
            history = self._data.get(user_id)
            return list(history) if history is not None else []

    def close(self) -> None:
        with self._lock:
            self._data.clear()
