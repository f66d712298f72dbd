"""A running server follows its live-catalog file (``recsvc catalog add|retire``; docs/CATALOG.md).

:class:`CatalogWatch` checks the file's modification time, size and inode every ``check_every_s`` from a small
background thread (never on the request path). On a change it checks the file's size against ``max_bytes``
(``--catalog-max-mb``; a larger file is rejected unread, with a reason naming the limit), then reads and
validates it against the bundle in another process (``recsvc.catalog.reader``: a JSON parse holds the
GIL, and in a thread of the server a 200 MB file stalled every request for seconds), builds the new catalog
state off the request path (``LiveRecommender.apply``: trie, priors, fresh items, exclusions) and swaps it in
with one assignment; batches already running finish on the previous state. A file that fails validation is
rejected with a ``catalog_update_rejected`` log line (its reason names the field, or the size limit) and the
previous catalog keeps serving; a successful update logs ``catalog_updated`` (version, added, retired, items,
seconds, read_s, build_s). A file that disappears changes nothing (write an empty catalog to go back to the bundle's).

At start (:func:`watch_catalog`), a file that is already there is applied before the server serves, and a
malformed one is a ``UserError``: the server does not start on a catalog it cannot read.

Prometheus (the server's registry): ``recsvc_catalog_version``, ``recsvc_catalog_items`` (recommendable items:
the bundle's plus added minus retired) and ``recsvc_catalog_updates_total{outcome="applied"|"rejected"}``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from recsvc.catalog.file import read_catalog
from recsvc.catalog.reader import read_catalog_isolated
from recsvc.errors import UserError
from recsvc.recommender.live_catalog import LiveRecommender
from recsvc.service.observability.logs import log_event

from .poll_thread import PollThread

log = logging.getLogger(__name__)
Stamp = tuple[int, int, int]


class CatalogWatch:
    def __init__(self, live: LiveRecommender, path: str | Path, check_every_s: float = 0.5,
                 max_bytes: int | None = None, isolated: bool = True) -> None:
        """``max_bytes``: the file size limit (None: ``live_catalog.max_catalog_bytes()``); ``isolated``: read
        in another process (False: in this thread, holding the GIL while the JSON parses; for comparison)."""
        self.live, self.path, self.check_every_s = live, Path(path), check_every_s
        self.max_bytes, self.isolated = max_bytes, isolated
        self._stamp: Stamp | None = None
        self._missing_logged = False
        self._lock = threading.Lock()  # one check at a time (the thread, or a caller of check())
        self._poll = PollThread("recsvc-catalog-watch", self.check, check_every_s)
        self.applied = 0
        self.rejected = 0
        self.last_reason: str | None = None  # the latest rejection's
        self.last_timing: tuple[float, float, float] | None = None  # the latest update's read, built, swapped

    @contextmanager
    def paused(self) -> Iterator[LiveRecommender]:
        """No file check runs meanwhile (a bundle swap carries the current catalog over, then :meth:`rebind`s):
        yields the live recommender changes are applied to now."""
        with self._lock:
            yield self.live

    def rebind(self, live: LiveRecommender) -> None:
        """Later changes of the file go to ``live`` (a new bundle version's, the catalog carried over; inside
        :meth:`paused`)."""
        self.live = live

    def _stat(self) -> Stamp | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)  # os.replace gives a new inode even on a coarse clock

    def load_initial(self) -> None:
        """Applies the file when it exists (UserError when it is malformed: fail before serving)."""
        stamp = self._stat()
        if stamp is not None:
            self._apply(stamp)
        state = self.live.state
        log_event(log, "catalog_watching", file=str(self.path), exists=stamp is not None,
                  version=state.catalog.version, items=state.items, check_every_s=self.check_every_s)

    def check(self) -> bool | None:
        """One look at the file: None when it has not changed, True when a change was applied, False when it
        was rejected (the previous catalog keeps serving)."""
        with self._lock:
            stamp = self._stat()
            if stamp is None:
                if self._stamp is not None and not self._missing_logged:
                    self._missing_logged = True
                    log_event(log, "catalog_file_missing", logging.WARNING, file=str(self.path),
                              serving_version=self.live.state.catalog.version)
                return None
            self._missing_logged = False
            if stamp == self._stamp:
                return None
            try:
                self._apply(stamp)
            except UserError as exc:
                self._reject(stamp, str(exc))
                return False
            except Exception as exc:  # a bug must not take the catalog (or the thread) down: keep serving
                log.exception("catalog update failed")
                self._reject(stamp, f"internal error: {exc!r}")
                return False
            return True

    def _apply(self, stamp: Stamp) -> None:
        began = time.time()
        read = read_catalog_isolated if self.isolated else read_catalog
        catalog = read(self.path, self.live.base.ids, self.live.vector_dim, self.max_bytes)
        was_read = time.time()
        state = self.live.apply(catalog)
        self._stamp = stamp
        self.applied += 1
        self.last_timing = (began, was_read, time.time())
        log_event(log, "catalog_updated", file=str(self.path), version=catalog.version,
                  added=len(catalog.item_ids), retired=len(catalog.retired), items=state.items,
                  seconds=round(time.time() - began, 3), read_s=round(was_read - began, 3),
                  build_s=round(time.time() - was_read, 3))

    def _reject(self, stamp: Stamp, reason: str) -> None:
        self._stamp = stamp  # not retried until the file changes again
        self.rejected += 1
        self.last_reason = reason
        log_event(log, "catalog_update_rejected", logging.WARNING, file=str(self.path), reason=reason,
                  serving_version=self.live.state.catalog.version)

    # ---- background thread ---------------------------------------------------------------------------------
    def start(self) -> CatalogWatch:
        self._poll.start()
        return self

    def close(self) -> None:
        self._poll.close()

    # ---- Prometheus ----------------------------------------------------------------------------------------
    def collect(self):
        state = self.live.state
        yield GaugeMetricFamily("recsvc_catalog_version", "Version of the live catalog served (0: the bundle's)",
                                value=state.catalog.version)
        yield GaugeMetricFamily("recsvc_catalog_items", "Recommendable items: the bundle's plus added minus retired",
                                value=state.items)
        updates = CounterMetricFamily("recsvc_catalog_updates", "Live-catalog file changes, by outcome",
                                      labels=["outcome"])
        updates.add_metric(["applied"], self.applied)
        updates.add_metric(["rejected"], self.rejected)
        yield updates


def watch_catalog(recommender, path: str | Path, registry=None, check_every_s: float = 0.5,
                  max_bytes: int | None = None) -> tuple[LiveRecommender, CatalogWatch]:
    """Wraps a bundle's recommender in a ``LiveRecommender``, applies ``path`` when it exists (UserError when
    it is malformed), starts watching it and registers the catalog metrics on ``registry`` (a Prometheus
    ``CollectorRegistry``; None: none). ``max_bytes``: the file size limit (None: the default)."""
    live = LiveRecommender(recommender)
    watch = CatalogWatch(live, path, check_every_s, max_bytes)
    watch.load_initial()
    if registry is not None:
        registry.register(watch)
    return live, watch.start()
