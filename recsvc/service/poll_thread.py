"""A daemon thread that calls ``check()`` every ``every_s`` seconds until closed: the file watchers' loop
(``catalog_watch.CatalogWatch``, ``bundle_watch.BundleWatch``).

    >>> calls = []
    >>> poll = PollThread("doc", lambda: calls.append(1), every_s=0.01).start()
    >>> poll.close()
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class PollThread:
    """``start()`` once (later calls do nothing), ``close()`` stops and joins; ``nice`` > 0 lowers the thread's CPU
    priority on Linux (a thread that loads models in the background yields to the serving threads)."""

    def __init__(self, name: str, check: Callable[[], object], every_s: float, nice: int = 0) -> None:
        self.name, self.check, self.every_s, self.nice = name, check, every_s, nice
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PollThread:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (AttributeError, OSError):  # not Linux, or not allowed: same priority
                pass
        while not self._stop.wait(self.every_s):
            self.check()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
