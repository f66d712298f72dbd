"""Dynamic batching by flat combining: the handlers' threads batch their queries among themselves.

A handler calls :meth:`Batcher.answer` with its query and blocks until the answer is there. A query that needs
no decoding (no history, or nothing left after the exclusions and rules: ``recsvc.recommender.answer``) is
answered at once, never queued. The others wait in one queue; the first waiting caller that finds the engine free
becomes the combiner: it collects up to ``max_batch`` queries (waiting at most ``max_wait`` for more), makes one
engine call for all of them, hands every caller its result and lets the next waiting caller take over. So a
query travels by plain calls from the handler to the recommender and the engine, and one engine call runs at a
time.

Queries whose deadline passed while queued, or whose RPC was cancelled, are dropped before the engine call (never
computed); a caller whose deadline passes while its query is being computed leaves with DeadlineExpired (a
combiner finishes its batch first: the others wait on it). The engine takes mixed queries (modes, k), so no
grouping is needed. If a batch fails, its queries are retried one by one so that a single poisonous query cannot
fail its neighbours. Idle work (:meth:`Batcher.offer_idle`) runs on a thread of its own, only while no query
waits and the engine is free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass

from recsvc.recommender.api import Answer, Recommender, RecQuery
from recsvc.service.observability.logs import log_event
from recsvc.service.observability.metrics import ServiceMetrics

log = logging.getLogger(__name__)
OnEnd = Callable[[Callable[[], object]], bool]  # grpc's context.add_callback: False when the RPC has ended


class DeadlineExpired(Exception):
    """The query's deadline passed before its answer was there."""


class Overloaded(Exception):
    """The queue is full; the client should back off (RESOURCE_EXHAUSTED)."""


class BatcherClosed(Exception):
    """The server is shutting down (UNAVAILABLE)."""


@dataclass(frozen=True)
class BatchOutcome:
    answer: Answer  # the result and how it was reached (``recsvc.recommender.answer``)
    batch_size: int  # live queries in the engine call that produced it (0: answered without decoding)


@dataclass
class _Pending:
    query: RecQuery
    deadline: float | None  # time.monotonic() seconds
    future: Future[BatchOutcome]
    queued: bool = True  # still in the queue (not yet taken into a batch, nor given up by its caller)


MAX_IDLE_TASKS = 256  # idle work waiting; the oldest is dropped beyond this


class Batcher:
    """Feeds ``recommender`` with batches of at most ``max_batch`` queries, one engine call at a time."""

    def __init__(
        self,
        recommender: Recommender,
        *,
        max_batch: int = 16,
        max_wait_s: float = 0.005,
        max_queue: int = 1024,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        if max_batch < 1 or max_wait_s < 0 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1 and max_wait_s >= 0")
        self.recommender = recommender
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.metrics = metrics
        self._cond = threading.Condition()
        self._waiting: deque[_Pending] = deque()  # queued queries, oldest first
        self._busy = False  # an engine call (or idle task) runs
        self._closed = False
        self._idle: deque[Callable[[], None]] = deque(maxlen=MAX_IDLE_TASKS)
        self._idle_thread = threading.Thread(target=self._idle_loop, name="recsvc-idle", daemon=True)
        self._idle_thread.start()

    def answer(self, query: RecQuery, deadline: float | None = None, on_end: OnEnd | None = None) -> BatchOutcome:
        """The answer to ``query``: at once when it needs no decoding, else from the batch it is computed in.
        ``deadline`` (time.monotonic()): DeadlineExpired after it. ``on_end(callback)``: registers a callback
        for when the caller goes away (the query is then skipped; CancelledError). Overloaded when the queue
        is full, BatcherClosed once closing."""
        answer = self.recommender.answer_now(query)  # (answered while closing too, as it needs no engine)
        if answer is not None:
            return BatchOutcome(answer, 0)
        pending = self._queue(query, deadline)
        if on_end is not None and not on_end(pending.future.cancel):
            pending.future.cancel()  # the RPC ended before the callback could be registered
        while True:
            batch = self._lead_or_wait(pending)
            if not batch:
                return self._outcome(pending)
            try:
                self._run(batch)
            except BaseException as exc:  # every caller of the batch hears of it; none waits forever
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                raise
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def offer_idle(self, task: Callable[[], None]) -> None:
        """Runs ``task`` on the idle thread when no query waits and the engine is free (never during an engine
        call): work ahead of demand, such as a user's prefill after a write. Never blocks the caller; dropped
        when the server closes or too many wait."""
        with self._cond:
            if self._closed:
                return
            self._idle.append(task)
            self._cond.notify_all()

    def close(self, timeout_s: float | None = None) -> None:
        """Stops accepting queries (the queued ones are still computed for their callers) and idle work."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._idle_thread.join(timeout_s)

    # ---- combining ------------------------------------------------------------------------------------------
    def _queue(self, query: RecQuery, deadline: float | None) -> _Pending:
        pending = _Pending(query, deadline, Future())
        pending.future.add_done_callback(self._wake)  # a cancellation wakes its waiting caller
        with self._cond:
            if self._closed:
                raise BatcherClosed("server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"engine queue is full ({self.max_queue} queries waiting)")
            self._waiting.append(pending)
            self._gauge()
            self._cond.notify_all()
        return pending

    def _wake(self, _future: Future) -> None:
        with self._cond:
            self._cond.notify_all()

    def _lead_or_wait(self, pending: _Pending) -> list[_Pending]:
        """The batch to run when this caller becomes the combiner (the engine is then its own); [] when its
        answer is there, or its wait is over (cancelled, deadline passed)."""
        with self._cond:
            while not pending.future.done():
                left = None if pending.deadline is None else pending.deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                if not self._busy and pending.queued:
                    self._busy = True
                    return self._collect()
                self._cond.wait(left)
            if pending.queued:  # never taken into a batch: it leaves the queue here, uncomputed
                pending.queued = False
                self._waiting.remove(pending)
                self._gauge()
                self._dropped("cancelled" if pending.future.cancelled() else "deadline")
            return []

    def _collect(self) -> list[_Pending]:
        """Up to ``max_batch`` of the oldest queued queries, after waiting at most ``max_wait`` for the batch to
        fill (called holding the lock, as the combiner)."""
        opened = time.monotonic()
        while len(self._waiting) < self.max_batch:
            left = opened + self.max_wait_s - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
        batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
        for item in batch:
            item.queued = False
        self._gauge()
        return batch

    def _outcome(self, pending: _Pending) -> BatchOutcome:
        future = pending.future
        if future.cancelled():
            raise CancelledError()
        if not future.done():  # the deadline passed (queued, or while its batch is computed)
            future.cancel()
            raise DeadlineExpired("deadline exceeded while the query was being computed")
        return future.result()

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
                    self._finish(item, result, 1)
            return
        for item, result in zip(live, results, strict=True):
            self._finish(item, result, len(live))

    def _finish(self, item: _Pending, answer: Answer, batch_size: int) -> None:
        item.future.set_result(BatchOutcome(answer, batch_size))

    def _call(self, items: list[_Pending]) -> list[Answer]:
        started = time.perf_counter()
        results = list(self.recommender.answers([item.query for item in items]))
        if len(results) != len(items):
            raise RuntimeError(f"engine returned {len(results)} results for {len(items)} queries")
        if self.metrics is not None:
            self.metrics.engine_seconds.observe(time.perf_counter() - started)
            self.metrics.batch_size.observe(len(items))
        return results

    # ---- idle work ------------------------------------------------------------------------------------------
    def _idle_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._idle or self._busy or self._waiting):
                    self._cond.wait()
                if self._closed:
                    return
                task = self._idle.popleft()
                self._busy = True
            try:
                task()
            except BaseException:  # idle work is best effort
                log.exception("idle task failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))

    def _dropped(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.expired.labels(reason).inc()
