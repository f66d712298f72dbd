"""Batcher unit behaviour with a real engine (popularity): batch bounds, deadlines, cancellation, overload, the
answers that need no engine call, idle work."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest

from recsvc.recommender.answer import NO_HISTORY_REASON, Answering
from recsvc.recommender.api import RecQuery, WithoutModel
from recsvc.service.rpc.batcher import Batcher, BatcherClosed, DeadlineExpired, Overloaded


class Gate(WithoutModel, Answering):
    """A recommender that blocks each engine call until released and records batch sizes."""

    def __init__(self, inner, fail_first: bool = False) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.sizes: list[int] = []
        self.fail_first = fail_first

    def popular_items(self, k, exclude=(), rules=None):
        return self.inner.popular_items(k, exclude, rules)

    def recommend(self, queries):
        self.sizes.append(len(queries))
        self.open.wait(10)
        if self.fail_first and len(self.sizes) == 1:
            return []
        return self.inner.recommend(queries)


def wait_until(condition, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_batches_respect_max_batch_and_complete_all(catalog):
    gate = Gate(catalog)
    batcher = Batcher(gate, max_batch=4, max_wait_s=0.05)
    try:
        with ThreadPoolExecutor(10) as pool:
            calls = [pool.submit(batcher.answer, RecQuery(history=[i + 1], k=2)) for i in range(10)]
            wait_until(lambda: sum(gate.sizes) >= 4)
            gate.open.set()
            outcomes = [c.result(5) for c in calls]
        assert all(len(o.answer.result.item_ids) == 2 for o in outcomes)
        assert max(gate.sizes) <= 4 and sum(gate.sizes) == 10
        assert any(o.batch_size > 1 for o in outcomes)
    finally:
        batcher.close(5)


def test_expired_and_cancelled_queries_never_reach_the_engine(catalog):
    gate = Gate(catalog)
    batcher = Batcher(gate, max_batch=1, max_wait_s=0.0)
    cancels = []
    try:
        with ThreadPoolExecutor(3) as pool:
            busy = pool.submit(batcher.answer, RecQuery(history=[1], k=1))
            wait_until(lambda: gate.sizes == [1])  # its caller is now blocked inside the engine with `busy`
            expired = pool.submit(batcher.answer, RecQuery(history=[2], k=1), time.monotonic() + 0.01)
            cancelled = pool.submit(batcher.answer, RecQuery(history=[3], k=1), None,
                                    lambda cancel: cancels.append(cancel) or True)
            wait_until(lambda: len(cancels) == 1)
            cancels[0]()  # the client goes away
            with pytest.raises(CancelledError):
                cancelled.result(5)
            with pytest.raises(DeadlineExpired):
                expired.result(5)
            gate.open.set()
            assert busy.result(5).answer.result.item_ids == [1]
        assert gate.sizes == [1]
    finally:
        batcher.close(5)


def test_overload_and_closed(catalog):
    gate = Gate(catalog)
    batcher = Batcher(gate, max_batch=1, max_wait_s=0.0, max_queue=2)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(batcher.answer, RecQuery(history=[1], k=1))
        wait_until(lambda: gate.sizes == [1])
        queued = [pool.submit(batcher.answer, RecQuery(history=[1], k=1)) for _ in range(2)]
        wait_until(lambda: len(batcher._waiting) == 2)
        with pytest.raises(Overloaded, match="queue is full"):
            batcher.answer(RecQuery(history=[1], k=1))
        gate.open.set()
        first.result(5)
        assert all(q.result(5).answer.result.item_ids == [1] for q in queued)
    batcher.close(5)
    with pytest.raises(BatcherClosed):
        batcher.answer(RecQuery(history=[1], k=1))


def test_wrong_result_count_fails_the_query_not_the_batcher(catalog):
    gate = Gate(catalog, fail_first=True)
    gate.open.set()
    batcher = Batcher(gate, max_batch=1, max_wait_s=0.0)
    try:
        with pytest.raises(RuntimeError, match="0 results for 1 queries"):
            batcher.answer(RecQuery(history=[1], k=1))
        assert batcher.answer(RecQuery(history=[1], k=1)).answer.result.item_ids == [1]
    finally:
        batcher.close(5)


def test_a_query_without_history_is_answered_without_the_engine(catalog):
    gate = Gate(catalog)  # closed: an engine call would block
    batcher = Batcher(gate, max_batch=1, max_wait_s=0.0)
    try:
        outcome = batcher.answer(RecQuery(history=[], k=3, exclude=(2,)))
        assert outcome.batch_size == 0 and gate.sizes == []
        assert outcome.answer.result.item_ids == [1, 3, 4] and outcome.answer.reason == NO_HISTORY_REASON
        nothing = batcher.answer(RecQuery(history=[1], k=1, exclude=tuple(range(1, 2001))))
        assert nothing.answer.result.item_ids == [] and nothing.answer.fallback == "nothing_left"
    finally:
        batcher.close(5)


def test_idle_work_waits_for_the_engine_call(catalog):
    gate = Gate(catalog)
    batcher = Batcher(gate, max_batch=1, max_wait_s=0.0)
    ran: list[int] = []
    try:
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(batcher.answer, RecQuery(history=[1], k=1))
            wait_until(lambda: gate.sizes == [1])
            batcher.offer_idle(lambda: ran.append(len(gate.sizes)))
            time.sleep(0.05)
            assert ran == []  # never during an engine call
            gate.open.set()
            busy.result(5)
        wait_until(lambda: ran == [1])
    finally:
        batcher.close(5)
