"""The bundle loader's throttle (recsvc/service/swap/loader_throttle.py) and what it asks: whether a call is decoding
(SwappableRecommender.busy). Counts only: the latency it buys is measured by tests/test_bundle_swap.py and
``recsvc bench swap``."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

from recsvc.recommender.api import RecQuery, RecResult
from recsvc.recommender.swappable import SwappableRecommender
from recsvc.service.swap.loader_throttle import LoaderThrottle


def work() -> int:
    return sum(len(sorted(str(i) for i in range(50))) for _ in range(200))


def test_it_sleeps_between_slices_while_calls_decode() -> None:
    with LoaderThrottle(lambda: True, run_s=0.0, pause_s=0.0) as throttle:
        work()
    assert throttle.pauses > 10
    assert throttle.stats()["pauses"] == throttle.pauses


def test_it_runs_freely_while_nothing_decodes() -> None:
    asked = []

    def busy() -> bool:
        asked.append(1)
        return False

    with LoaderThrottle(busy, run_s=0.0, pause_s=1.0) as throttle:
        work()
    assert asked and throttle.pauses == 0 and throttle.paused_s == 0.0


def test_only_the_loading_thread_is_throttled_and_the_previous_profiler_comes_back() -> None:
    events: list[str] = []

    def previous(_frame, event, _arg) -> None:
        events.append(event)

    seen_elsewhere: list[object] = []
    sys.setprofile(previous)
    try:
        with LoaderThrottle(lambda: True, run_s=0.0, pause_s=0.0):
            other = threading.Thread(target=lambda: seen_elsewhere.append(sys.getprofile()))
            other.start()
            other.join()
            assert sys.getprofile() is not previous
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)
    assert seen_elsewhere == [None]  # a serving thread never runs the throttle's profile function


class Recording:
    """A recommender that records whether the swappable one said busy while it decoded."""

    max_k = max_history = 10
    exclude_history = prefill_ahead_enabled = False
    rule_catalog = states = facts = None

    def __init__(self) -> None:
        self.outer: SwappableRecommender | None = None
        self.busy_seen: list[bool] = []

    def known_item(self, item_id: int) -> bool:
        return True

    def recommend(self, queries: Sequence[RecQuery]) -> list[RecResult]:
        assert self.outer is not None
        self.busy_seen.append(self.outer.busy)
        raise RuntimeError("decode failed")  # the count must come back down on errors too


def test_swappable_is_busy_while_a_call_decodes() -> None:
    inner = Recording()
    outer = SwappableRecommender(inner)  # type: ignore[arg-type]
    inner.outer = outer
    assert not outer.busy
    for _ in range(2):
        try:
            outer.recommend([RecQuery(history=(1, 2), k=3)])
        except RuntimeError:
            pass
    assert inner.busy_seen == [True, True] and not outer.busy
