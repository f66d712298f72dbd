"""The item histories served most recently: what a new bundle version warms on before it serves
(``recsvc.service.swap.bundle_watch``), so that the users active at the swap do not meet a cold version.

A swap empties the user-state cache (a new target's keys and values differ), so each active user's first
request on the new version would pay its whole prompt's prefill and its prior row at once: with a few busy users
those requests are the swap's slowest. TF Serving warms a new model version on recorded requests for the same
reason. The histories are kept as item ids (not prompt tokens): the new version's ids may differ.

    >>> recent = RecentHistories(capacity=2)
    >>> for h in [(1, 2), (3,), (1, 2), (4, 5)]:
    ...     recent.add(h)
    >>> recent.latest()
    [[4, 5], [1, 2]]
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

RECENT_HISTORIES = 16  # distinct histories kept (the newest first when read)


class RecentHistories:
    """The last ``capacity`` distinct histories (a bounded LRU; thread-safe, O(1) per request)."""

    def __init__(self, capacity: int = RECENT_HISTORIES) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, history: Sequence[int]) -> None:
        if not history or self.capacity <= 0:
            return
        key = tuple(history)
        with self._lock:
            self._seen[key] = None
            self._seen.move_to_end(key)
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def latest(self) -> list[list[int]]:
        """The kept histories, the most recent first."""
        with self._lock:
            return [list(h) for h in reversed(self._seen)]
