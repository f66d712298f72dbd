"""Whether the server is answering calls now: what a bundle version loading beside the serving one yields to
(``recsvc.service.swap.loader_throttle``).

A call is counted from the moment its handler runs until it returns, and the server stays "busy" for
``linger_s`` after the last one ended: a caller's next request follows its last answer by a network round trip,
and a loader running freely in that gap holds the GIL when the request's handler needs it (CPython hands the
GIL over only after the switch interval, 5 ms, to a thread that keeps computing). Counting only the decoding
(``SwappableRecommender.busy``) left those gaps, and the history reads and answer building around each decode,
to the loader at full speed: it held the GIL a quarter of the time during a swap under load.

    >>> calls = CallActivity(linger_s=0.0)
    >>> with calls.call():
    ...     calls.busy()
    True
    >>> calls.busy()
    False
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

LINGER_S = 0.05  # busy this long after the last call ended (several round trips on a LAN)


class CallActivity:
    def __init__(self, linger_s: float = LINGER_S) -> None:
        self.linger_s = linger_s
        self._in_flight = 0  # under _lock
        self._last_end = float("-inf")  # time.monotonic() when the last call ended
        self._lock = threading.Lock()

    @contextmanager
    def call(self) -> Iterator[None]:
        """Around one call's handler."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._last_end = time.monotonic()

    def busy(self) -> bool:
        """A call in progress, or one ended less than ``linger_s`` ago (reads without the lock)."""
        return self._in_flight > 0 or time.monotonic() - self._last_end < self.linger_s
