"""Batcher unit behaviour with a real engine (popularity): batch bounds, deadlines, cancellation, overload."""

from __future__ import annotations

import threading
import time

import pytest

from recsvc.recommender.api import RecQuery
from recsvc.service.batcher import Batcher, BatcherClosed, DeadlineExpired, Overloaded


class Gate:
    """An engine wrapper that blocks until released and records batch sizes."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.sizes: list[int] = []

    def __call__(self, queries):
        self.sizes.append(len(queries))
        self.open.wait(10)
        return self.inner.recommend(queries)


def test_batches_respect_max_batch_and_complete_all(catalog):
    gate = Gate(catalog)
    batcher = Batcher(gate, max_batch=4, max_wait_s=0.05)
    try:
        futures = [batcher.submit(RecQuery(history=[i + 1], k=2)) for i in range(10)]
        gate.open.set()
        outcomes = [f.result(5) for f in futures]
        assert all(len(o.result.item_ids) == 2 for o in outcomes)
        assert max(gate.sizes) <= 4 and sum(gate.sizes) == 10
        assert any(o.batch_size > 1 for o in outcomes)
    finally:
        batcher.close(5)


def test_expired_and_cancelled_queries_never_reach_the_engine(catalog):
    gate = Gate(catalog)
    batcher = Batcher(gate, max_batch=1, max_wait_s=0.0)
    try:
        busy = batcher.submit(RecQuery(history=[1], k=1))
        time.sleep(0.05)  # the worker is now blocked inside the engine with `busy`
        expired = batcher.submit(RecQuery(history=[2], k=1), deadline=time.monotonic() + 0.01)
        cancelled = batcher.submit(RecQuery(history=[3], k=1))
        assert cancelled.cancel()
        time.sleep(0.05)
        gate.open.set()
        assert busy.result(5).result.item_ids == [1]
        with pytest.raises(DeadlineExpired):
            expired.result(5)
        assert gate.sizes == [1]
    finally:
        batcher.close(5)


def test_overload_and_closed(catalog):
    gate = Gate(catalog)
    batcher = Batcher(gate, max_batch=1, max_wait_s=0.0, max_queue=2)
    first = batcher.submit(RecQuery(history=[1], k=1))
    time.sleep(0.05)
    batcher.submit(RecQuery(history=[1], k=1))
    batcher.submit(RecQuery(history=[1], k=1))
    with pytest.raises(Overloaded, match="queue is full"):
        batcher.submit(RecQuery(history=[1], k=1))
    gate.open.set()
    first.result(5)
    batcher.close(5)
    with pytest.raises(BatcherClosed):
        batcher.submit(RecQuery(history=[1], k=1))


def test_wrong_result_count_fails_the_queries_not_the_worker(catalog):
    calls = []

    def engine(queries):
        calls.append(len(queries))
        return [] if len(calls) == 1 else catalog.recommend(queries)

    batcher = Batcher(engine, max_batch=1, max_wait_s=0.0)
    try:
        with pytest.raises(RuntimeError, match="0 results for 1 queries"):
            batcher.submit(RecQuery(history=[1], k=1)).result(5)
        assert batcher.submit(RecQuery(history=[1], k=1)).result(5).result.item_ids == [1]
    finally:
        batcher.close(5)
