"""A daemon thread that calls ``check()`` every ``every_s`` seconds until closed: the file watchers' loop
(``catalog_watch.CatalogWatch``, ``bundle_watch.BundleWatch``).

    >>> calls = []
    >>> poll = PollThread("doc", lambda: calls.append(1), every_s=0.01).start()
    >>> poll.close()
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PollThread:
    """``start()`` once (later calls do nothing), ``close()`` stops and joins. The thread keeps the normal CPU
    priority: a lowered one (nice) preempted while it holds the GIL would stall the serving threads."""

    def __init__(self, name: str, check: Callable[[], object], every_s: float) -> None:
        self.name, self.check, self.every_s = name, check, every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PollThread:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
