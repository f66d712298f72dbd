"""A new bundle version without downtime: ``recsvc serve --bundle PATH`` follows PATH (a symlink such as
``current`` -> ``versions/v7``) and serves the version it points to, loaded beside the serving one.

:class:`BundleWatch` resolves PATH every ``check_every_s`` (``--bundle-watch-s``) from a background thread (never
on the request path). When it points to another version directory (``ln -sfn versions/v8 current.tmp && mv -T
current.tmp current``: an atomic flip), or on SIGHUP (``request_reload``: the same directory again, e.g. after a
tuning rewrote it in place), the new version is

1. loaded beside the serving one (``load``: the factory ``settings.build_recommender`` with the same flags:
   models, forward, speculation, from the new bundle's own choices: beam width, history exclusion), while the
   old one keeps serving every request;
2. given the live catalog: the items added and retired at run time, carried over and validated against the
   new bundle's ids (``recsvc.catalog.carry``), while no catalog change is applied (``CatalogWatch.paused``);
3. warmed: it answers the warm-up queries (the default mode and plain, on popular items, the bundle's
   calibration histories and the histories served lately, ``SwappableRecommender.recent``: the active users'
   next requests find its state cache warm) before it serves anything;
4. swapped in with one assignment (``SwappableRecommender.swap``): a batch that started on the old version
   finishes on it, the next one runs on the new one; the old user-state cache is emptied (its memory back).

While calls are being answered (``recsvc.service.swap.call_activity``), the loading thread (load, catalog, warm-up)
runs in slices of about 0.5 ms and sleeps 4.5 ms, or 9x the CPU time the slice used, between them
(``recsvc.service.swap.loader_throttle``): the
requests served meanwhile keep the GIL and the cores, the load takes longer. Its thread keeps the normal CPU
priority: a lower one would let the scheduler preempt it while it holds the GIL, stalling the serving threads.
tests/test_bundle_swap.py measures the p99 of the requests served during a swap against the p99 before;
``recsvc bench swap`` repeats it.

User histories live in the history store (Redis, or the process's memory), not in the bundle: they carry over
as they are. When the new version fails to load, to take the catalog or to warm, the old one keeps serving:
``bundle_swap_rejected`` is logged with the reason (WARNING), counted, and the same version is not tried again
until PATH points elsewhere, its bundle.json changes, or SIGHUP. A successful swap logs ``bundle_swapped``.

Prometheus (the server's registry): ``recsvc_bundle_swaps_total{outcome="applied"|"rejected"}``,
``recsvc_bundle_serving_info{bundle=<version directory>}`` (1), ``recsvc_bundle_last_swap_seconds``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from recsvc.bundle.directory import META_FILE
from recsvc.bundle.serving_files import read_calibration_histories
from recsvc.catalog.carry import carried_over
from recsvc.errors import UserError
from recsvc.recommender.api import Recommender
from recsvc.recommender.bundle_recommender import BundleRecommender
from recsvc.recommender.live_catalog import LiveRecommender
from recsvc.recommender.swappable import SwappableRecommender
from recsvc.service.observability.logs import log_event

from .catalog_watch import CatalogWatch
from .loader_throttle import LoaderThrottle
from .poll_thread import PollThread

log = logging.getLogger(__name__)
Key = tuple[str, tuple[int, int, int]]  # (version directory, bundle.json's mtime_ns, size, inode)
WARM_HISTORIES = 4  # calibration histories the new version is warmed on (besides popular items)


def warm_histories(rec: Recommender, stored: list[list[int]], recent: list[list[int]]) -> list[list[int]]:
    """What a new version warms on: ``WARM_HISTORIES`` of the bundle's calibration histories, then the histories
    served lately (``RecentHistories``: their users' first requests then find the new version's state cache
    warm), each once, with the items the new version does not know left out."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for history in [*stored[:WARM_HISTORIES], *recent]:
        known = [i for i in history if rec.known_item(i)]
        if known and tuple(known) not in seen:
            seen.add(tuple(known))
            out.append(known)
    return out


def version_key(path: str | Path) -> Key | None:
    """The version directory ``path`` resolves to and its bundle.json's stamp; None while it has none."""
    target = os.path.realpath(path)
    try:
        st = os.stat(os.path.join(target, META_FILE))
    except OSError:
        return None
    return target, (st.st_mtime_ns, st.st_size, st.st_ino)


class BundleWatch:
    def __init__(self, served: SwappableRecommender, path: str | Path, load: Callable[[str], BundleRecommender],
                 warm: Callable[[Recommender, list[list[int]]], object], catalog: CatalogWatch | None = None,
                 check_every_s: float = 1.0, on_swapped: Callable[[], None] | None = None,
                 serving: str | None = None, busy: Callable[[], bool] | None = None) -> None:
        """``served``: what the server answers with; ``path``: the bundle path given to ``recsvc serve``;
        ``load(version_dir)``: a new version's recommender (UserError / any exception: rejected); ``warm(rec,
        histories)``: raises when ``rec`` cannot answer; ``catalog``: the live-catalog watch whose catalog is
        carried over; ``on_swapped``: called after each swap (e.g. ``gc.freeze``); ``serving``: the version
        directory served now (default: the one ``path`` resolves to); ``busy()``: whether calls are being
        answered, the loader then works in slices (default: ``served`` is decoding)."""
        self.served, self.path, self.load, self.warm = served, str(path), load, warm
        self.catalog, self.check_every_s, self.on_swapped = catalog, check_every_s, on_swapped
        self.serving = serving or os.path.realpath(self.path)  # the version directory served
        self.busy = busy or (lambda: served.busy)
        self._rejected: Key | None = None
        self._reload = threading.Event()
        self._lock = threading.Lock()
        self._poll = PollThread("recsvc-bundle-watch", self.check, check_every_s)
        self.applied = 0
        self.rejected = 0
        self.last_reason: str | None = None
        self.last_swap_s = 0.0

    def request_reload(self) -> None:
        """Load the version PATH points to at the next check even when it is the served one (SIGHUP)."""
        self._reload.set()

    def check(self) -> bool | None:
        """One look at PATH: None when nothing is to be loaded, True when a new version was swapped in, False
        when it was rejected (the old one keeps serving)."""
        with self._lock:
            forced = self._reload.is_set()
            key = version_key(self.path)
            if key is None:
                return None  # mid-flip, or PATH has no bundle now: keep serving, look again
            if not forced and (key[0] == self.serving or key == self._rejected):
                return None
            self._reload.clear()
            return self._swap(key)

    def _swap(self, key: Key) -> bool:
        target = key[0]
        began = time.monotonic()
        log_event(log, "bundle_loading", bundle=target, serving=self.serving)
        throttle = LoaderThrottle(self.busy)
        try:
            with throttle:  # in slices while requests are decoded
                base = self.load(target)
                loaded = time.monotonic()
                live = LiveRecommender(base)
                histories = warm_histories(base, read_calibration_histories(target) or [],
                                           self.served.recent.latest())
                if self.catalog is not None:
                    with self.catalog.paused() as current:
                        carried, dropped = carried_over(current.state.catalog, base.ids, live.vector_dim)
                        live.apply(carried)
                        warming = time.monotonic()
                        self.warm(live, histories)
                        old = self.served.swap(live)
                        self.catalog.rebind(live)
                else:
                    carried, dropped = None, {}
                    warming = time.monotonic()
                    self.warm(live, histories)
                    old = self.served.swap(live)
        except UserError as exc:
            return self._reject(key, str(exc))
        except Exception as exc:  # a broken bundle must not take the server down: the old one keeps serving
            log.exception("bundle swap failed")
            return self._reject(key, f"{type(exc).__name__}: {exc}")
        if old.states is not None and old.states is not live.states:
            old.states.clear()  # its memory back (a batch still on the old version just misses)
        swapped = time.monotonic()
        previous, self.serving = self.serving, target
        self._rejected = None
        self.applied += 1
        self.last_swap_s = time.monotonic() - began
        if self.on_swapped is not None:
            self.on_swapped()
        log_event(log, "bundle_swapped", bundle=target, previous=previous, seconds=round(self.last_swap_s, 3),
                  load_s=round(loaded - began, 3), warm_s=round(swapped - warming, 3),
                  warmed_histories=len(histories), **throttle.stats(),
                  catalog_version=carried.version if carried is not None else None,
                  catalog_added=len(carried.item_ids) if carried is not None else 0,
                  catalog_retired=len(carried.retired) if carried is not None else 0, **dropped)
        return True

    def _reject(self, key: Key, reason: str) -> bool:
        self._rejected = key  # not tried again until PATH or its bundle.json changes, or SIGHUP
        self.rejected += 1
        self.last_reason = reason
        log_event(log, "bundle_swap_rejected", logging.WARNING, bundle=key[0], reason=reason, serving=self.serving)
        return False

    # ---- background thread ---------------------------------------------------------------------------------
    def start(self) -> BundleWatch:
        self._poll.start()  # this thread loads new versions: the serving threads come first for the CPU
        log_event(log, "bundle_watching", path=self.path, serving=self.serving, check_every_s=self.check_every_s)
        return self

    def close(self) -> None:
        self._poll.close()

    # ---- Prometheus ----------------------------------------------------------------------------------------
    def collect(self):
        swaps = CounterMetricFamily("recsvc_bundle_swaps", "Bundle versions swapped in, by outcome", labels=["outcome"])
        swaps.add_metric(["applied"], self.applied)
        swaps.add_metric(["rejected"], self.rejected)
        yield swaps
        info = GaugeMetricFamily("recsvc_bundle_serving_info", "The bundle version directory served (1)",
                                 labels=["bundle"])
        info.add_metric([self.serving], 1)
        yield info
        yield GaugeMetricFamily("recsvc_bundle_last_swap_seconds", "Load, catalog, warm-up and swap of the last "
                                "version swapped in (0: none yet)", value=self.last_swap_s)
