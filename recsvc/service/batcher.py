"""Dynamic batching: one thread collects queued queries (up to ``max_batch`` or ``max_wait``) per engine call.

Handlers ``submit`` a query and wait on the returned future. Queries whose deadline passed while queued, or
whose RPC was cancelled, are dropped before the engine call (never computed). The engine takes mixed
queries (modes, k), so no grouping is needed. If a batch fails, its queries are retried one by one so that a
single poisonous query cannot fail its neighbours. The engine is only ever called from the batcher thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from recsvc.recommender.api import RecQuery, RecResult

from .logs import log_event
from .metrics import ServiceMetrics

log = logging.getLogger(__name__)
Engine = Callable[[Sequence[RecQuery]], list[RecResult]]


class DeadlineExpired(Exception):
    """The query's deadline passed before the engine got to it."""


class Overloaded(Exception):
    """The queue is full; the client should back off (RESOURCE_EXHAUSTED)."""


class BatcherClosed(Exception):
    """The server is shutting down (UNAVAILABLE)."""


@dataclass(frozen=True)
class BatchOutcome:
    result: RecResult
    batch_size: int  # live queries in the engine call that produced ``result``


@dataclass
class _Pending:
    query: RecQuery
    deadline: float | None  # time.monotonic() seconds
    future: Future[BatchOutcome]


_STOP = object()
_IDLE = object()  # wakes the worker for idle work (offer_idle)
MAX_IDLE_TASKS = 256  # idle work waiting; the oldest is dropped beyond this


class Batcher:
    """Feeds ``engine`` with batches of at most ``max_batch`` queries from one worker thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 16,
        max_wait_s: float = 0.005,
        max_queue: int = 1024,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        if max_batch < 1 or max_wait_s < 0 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1 and max_wait_s >= 0")
        self.engine = engine
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.metrics = metrics
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._closed = False
        self._idle: deque[Callable[[], None]] = deque(maxlen=MAX_IDLE_TASKS)
        self._thread = threading.Thread(target=self._loop, name="recsvc-batcher", daemon=True)
        self._thread.start()

    def submit(self, query: RecQuery, deadline: float | None = None) -> Future[BatchOutcome]:
        """Queues ``query``; its future gets a :class:`BatchOutcome`, DeadlineExpired or the engine error."""
        pending = _Pending(query, deadline, Future())
        with self._lock:
            if self._closed:
                raise BatcherClosed("server is shutting down")
            try:
                self._queue.put_nowait(pending)
            except queue.Full:
                raise Overloaded(f"engine queue is full ({self._queue.maxsize} queries waiting)") from None
        self._gauge()
        return pending.future

    def offer_idle(self, task: Callable[[], None]) -> None:
        """Runs ``task`` on the worker thread when no query is waiting (between engine calls, never during one):
        work ahead of demand, such as a user's prefill after a write. Never blocks the caller; dropped when the
        server closes or too many wait."""
        with self._lock:
            if self._closed:
                return
            self._idle.append(task)
        try:
            self._queue.put_nowait(_IDLE)
        except queue.Full:  # the worker is busy anyway and will find the task once the queue drains
            pass

    def _run_idle(self) -> None:
        while self._idle and self._queue.empty():
            try:
                task = self._idle.popleft()
            except IndexError:
                return
            try:
                task()
            except BaseException:  # idle work is best effort
                log.exception("idle task failed")

    def close(self, timeout_s: float | None = None) -> None:
        """Stops accepting queries, finishes the queued ones, joins the worker."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._queue.qsize())

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            self._run_idle()
            first = self._queue.get()
            if first is _STOP:
                break
            if first is _IDLE:
                continue
            batch = [first]
            opened = time.monotonic()
            while len(batch) < self.max_batch:
                remaining = opened + self.max_wait_s - time.monotonic()
                try:
                    item = self._queue.get_nowait() if remaining <= 0 else self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                if item is not _IDLE:
                    batch.append(item)
            self._gauge()
            try:
                self._run(batch)  # type: ignore[arg-type]
            except BaseException:  # never let the worker die; futures are completed inside _run
                log.exception("batcher loop error")

    def _run(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        live: list[_Pending] = []
        for item in batch:
            expired = item.deadline is not None and item.deadline <= now
            if not item.future.set_running_or_notify_cancel():  # the RPC was cancelled or timed out
                self._dropped("deadline" if expired else "cancelled")
                continue
            if expired:
                item.future.set_exception(DeadlineExpired("deadline exceeded while queued"))
                self._dropped("deadline")
                continue
            live.append(item)
        if not live:
            return
        try:
            results = self._call(live)
        except Exception as exc:
            if len(live) == 1:
                live[0].future.set_exception(exc)
                return
            log_event(
                log, "batch_failed_retrying_singly", logging.WARNING, batch_size=len(live), error=repr(exc)
            )
            for item in live:
                try:
                    (result,) = self._call([item])
                except Exception as single_exc:
                    item.future.set_exception(single_exc)
                else:
                    item.future.set_result(BatchOutcome(result, 1))
            return
        for item, result in zip(live, results, strict=True):
            item.future.set_result(BatchOutcome(result, len(live)))

    def _dropped(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.expired.labels(reason).inc()

    def _call(self, items: list[_Pending]) -> list[RecResult]:
        started = time.perf_counter()
        results = list(self.engine([item.query for item in items]))
        if len(results) != len(items):
            raise RuntimeError(f"engine returned {len(results)} results for {len(items)} queries")
        if self.metrics is not None:
            self.metrics.engine_seconds.observe(time.perf_counter() - started)
            self.metrics.batch_size.observe(len(items))
        return results
