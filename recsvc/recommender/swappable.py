"""The served recommender behind one reference that a new bundle version replaces while the server runs
(``recsvc.service.swap.bundle_watch``): TF Serving's model versions, for one model.

Every member of the ``Recommender`` contract reads the current recommender once, so a batch that started on
the previous bundle finishes on it (``answers`` decodes the whole batch on the recommender it read), and the
next one runs on the new bundle. A request validated against the previous bundle may reach the new one: once a
swap happened, history items that the serving bundle does not know are left out of the prompt rather than failing
the batch (before any swap, validation against the only bundle already did that).

``busy`` says whether a call is decoding now: a new version loads in slices while it is
(``recsvc.service.swap.loader_throttle``). ``recent`` keeps the histories served lately: a new version warms on them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from recsvc.recommender.api import Answer, EngineFacts, Recommender, RecQuery, RecResult
from recsvc.recommender.recent_histories import RecentHistories
from recsvc.rules.spec import Rules

if TYPE_CHECKING:
    from recsvc.engine.caches.state_cache import UserStateCache
    from recsvc.rules.catalog import RuleCatalog


def known_only(rec: Recommender, queries: Sequence[RecQuery]) -> Sequence[RecQuery]:
    """``queries`` with history items ``rec`` does not know left out (the same objects when it knows them all)."""
    out = []
    for q in queries:
        if all(rec.known_item(i) for i in q.history):
            out.append(q)
        else:
            out.append(replace(q, history=[i for i in q.history if rec.known_item(i)]))
    return out


class SwappableRecommender:
    """A ``Recommender`` whose recommender :meth:`swap` replaces (one assignment: atomic for every reader)."""

    def __init__(self, current: Recommender) -> None:
        self._current = current
        self._swap_lock = threading.Lock()
        self.swaps = 0
        self._calls = 0  # calls in progress (decoding), under _calls_lock
        self._calls_lock = threading.Lock()
        self.recent = RecentHistories()  # what a new version warms on before it serves

    @property
    def current(self) -> Recommender:
        return self._current

    @property
    def busy(self) -> bool:
        """Whether a call is decoding now (a read of one int: no lock)."""
        return self._calls > 0

    @contextmanager
    def _decoding(self) -> Iterator[Recommender]:
        """The served recommender, read once (a whole batch on one bundle), counted in ``busy`` while in use."""
        with self._calls_lock:
            self._calls += 1
        try:
            yield self._current
        finally:
            with self._calls_lock:
                self._calls -= 1

    def swap(self, new: Recommender) -> Recommender:
        """Makes ``new`` the served recommender; returns the previous one (batches that read it finish on it)."""
        with self._swap_lock:
            old, self._current = self._current, new
            self.swaps += 1
            return old

    # ---- Recommender --------------------------------------------------------------------------------------
    @property
    def max_k(self) -> int:
        return self._current.max_k

    @property
    def max_history(self) -> int:
        return self._current.max_history

    @property
    def exclude_history(self) -> bool:
        return self._current.exclude_history

    @property
    def rule_catalog(self) -> RuleCatalog | None:
        return self._current.rule_catalog

    @property
    def states(self) -> UserStateCache | None:
        return self._current.states

    @property
    def prefill_ahead_enabled(self) -> bool:
        return self._current.prefill_ahead_enabled

    @property
    def facts(self) -> EngineFacts:
        return self._current.facts

    def known_item(self, item_id: int) -> bool:
        return self._current.known_item(item_id)

    def semantic_id(self, item_id: int) -> list[str]:
        return self._current.semantic_id(item_id)

    @property
    def has_item_keys(self) -> bool:
        return self._current.has_item_keys

    def key_of(self, item_id: int) -> str | None:
        return self._current.key_of(item_id)

    def item_of_key(self, key: str) -> int | None:
        return self._current.item_of_key(key)

    def popular_items(self, k: int, exclude: Sequence[int] = (), rules: Rules | None = None) -> list[int]:
        return self._current.popular_items(k, exclude, rules)

    def _note(self, queries: Sequence[RecQuery]) -> None:
        for q in queries:
            self.recent.add(q.history)

    def recommend(self, queries: Sequence[RecQuery]) -> list[RecResult]:
        self._note(queries)
        with self._decoding() as rec:
            return rec.recommend(known_only(rec, queries) if self.swaps else queries)

    def answer_now(self, query: RecQuery) -> Answer | None:
        self._note([query])
        with self._decoding() as rec:
            return rec.answer_now(known_only(rec, [query])[0] if self.swaps else query)

    def answers(self, queries: Sequence[RecQuery]) -> list[Answer]:
        self._note(queries)
        with self._decoding() as rec:
            return rec.answers(known_only(rec, queries) if self.swaps else queries)

    def prefill_ahead(self, history: Sequence[int]) -> None:
        with self._decoding() as rec:
            rec.prefill_ahead([i for i in history if rec.known_item(i)])
