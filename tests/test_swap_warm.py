"""What keeps a bundle swap out of the requests' way, piece by piece: the histories served lately (the new
version warms on them), the call activity the loader yields to, and the loading code's short calls (the trie's
table in row chunks, the popularity order as one sort, each code token parsed once)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from recsvc.errors import UserError
from recsvc.recommender.parts import popular_order
from recsvc.recommender.recent_histories import RecentHistories
from recsvc.service.swap.bundle_watch import WARM_HISTORIES, warm_histories
from recsvc.service.swap.call_activity import CallActivity
from recsvc.service.swap.loader_throttle import LoaderThrottle
from tokenizer_rqvae import trie as trie_module
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie


def test_recent_histories_keep_the_newest_distinct_ones() -> None:
    recent = RecentHistories(capacity=3)
    for h in [(1, 2), (3,), (), (1, 2), (4,), (5, 6)]:
        recent.add(h)
    assert recent.latest() == [[5, 6], [4], [1, 2]]  # (3,) fell out; the empty history is never kept
    assert RecentHistories(capacity=0).latest() == []


class Known:
    """The one method ``warm_histories`` asks of a recommender."""

    def __init__(self, items: set[int]) -> None:
        self.items = items

    def known_item(self, item_id: int) -> bool:
        return item_id in self.items


def test_a_new_version_warms_on_its_calibration_histories_then_the_recent_ones() -> None:
    stored = [[1, 2], [9, 9], [3]] + [[10 + i] for i in range(WARM_HISTORIES)]
    recent = [[2, 7, 1], [3], [7], [1, 2]]
    got = warm_histories(Known({1, 2, 3, 10, 11, 12, 13}), stored, recent)
    # stored: the first WARM_HISTORIES, unknown items left out (as serving leaves them out of the prompt),
    # a history with no known item dropped; then the recent ones not already there
    assert got == [[1, 2], [3], [10], [2, 1]]


def test_call_activity_counts_calls_and_lingers_after_the_last() -> None:
    calls = CallActivity(linger_s=0.2)
    assert not calls.busy()
    with calls.call():
        with calls.call():
            assert calls.busy()
        assert calls.busy()
    assert calls.busy()  # just ended: the caller's next request is on its way
    time.sleep(0.25)
    assert not calls.busy()
    with pytest.raises(RuntimeError), calls.call():
        raise RuntimeError("a failed call ends too")
    assert calls._in_flight == 0


def test_the_throttled_loader_sleeps_only_while_calls_are_answered() -> None:
    calls = CallActivity(linger_s=0.0)
    with LoaderThrottle(calls.busy, run_s=0.0, pause_s=0.0) as idle:
        sorted(str(i) for i in range(3000))
    with calls.call(), LoaderThrottle(calls.busy, run_s=0.0, pause_s=0.0) as busy:
        sorted(str(i) for i in range(3000))
    assert idle.pauses == 0 and busy.pauses > 0


def test_the_popularity_order_sorts_by_count_then_item_id() -> None:
    ids = SemanticIds(np.array([1, 2, 3, 5, 9]), np.zeros((5, 4), dtype=np.int64))
    assert popular_order(ids, {5: 3, 2: 3, 9: 1, 77: 8}) == [2, 5, 9, 1, 3]  # 77 is not in the catalog
    assert popular_order(ids, None) == [1, 2, 3, 5, 9]


def test_the_trie_table_filled_in_chunks_equals_one_fill(monkeypatch) -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 8, size=(300, 3))
    ids = SemanticIds(np.arange(1, 301), codes, codebook_size=8)
    whole = CatalogTrie(ids).children.clone()
    monkeypatch.setattr(trie_module, "FILL_ROWS", 3)  # many chunks, a ragged last one
    chunked = CatalogTrie(ids).children
    assert chunked.equal(whole) and int((whole >= 0).sum()) > 0


def test_semantic_ids_parse_each_token_once_and_reject_non_strings(tmp_path) -> None:
    path = tmp_path / "semantic_ids.json"
    path.write_text(json.dumps({"1": ["<a_1>", "<b_2>"], "2": ["<a_1>", "<b_3>"]}))
    ids = SemanticIds.load(path)
    assert ids.codes.tolist() == [[1, 2], [1, 3]]
    path.write_text(json.dumps({"1": ["<a_1>", ["<b_2>"]]}))
    with pytest.raises(UserError, match="not a code token"):
        SemanticIds.load(path)


def test_a_calibration_under_the_loader_throttle_times_cpu_not_its_sleeps() -> None:
    """A version swapped in with ``--spec auto`` calibrates in the throttled loading thread: on one CPU thread
    the runs are timed in that thread's CPU time, which the throttle's sleeps do not add to."""
    from recsvc.service.startup.calibration import calibration_clock

    assert calibration_clock("cpu", 1) is time.thread_time
    assert calibration_clock("cpu", 2) is time.perf_counter and calibration_clock("cuda", 1) is time.perf_counter
    clock = calibration_clock("cpu", 1)
    with LoaderThrottle(lambda: True, run_s=0.0, pause_s=0.01) as throttle:
        began, wall = clock(), time.monotonic()
        sorted(str(i) for i in range(20000))
        took, waited = clock() - began, time.monotonic() - wall
    assert throttle.pauses > 0 and throttle.paused_s > 0.05
    assert took < waited - 0.8 * throttle.paused_s  # the sleeps are in the wall time, not in the CPU time


def test_the_swap_bench_reads_a_process_resident_memory() -> None:
    """``recsvc bench swap`` prints the server's resident memory after each swap (a retired version must be
    freed): read from /proc, None for a process that is not there."""
    import os

    from bench.swap import resident_mb

    mine = resident_mb(os.getpid())
    assert mine is not None and 10 < mine < 100_000
    assert resident_mb(2**22 + 12345) is None  # above Linux's pid_max default: no such process
