"""Popularity recommender: the cold-start answer (users without history) and a model-free service mode.

It implements the engine's :class:`recsvc.recommender.api.Recommender` protocol from an item -> count table:
every query gets the most popular items that are not excluded (the history itself is ignored), with
``score = log(count / total)`` and zero engine forward calls.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from recsvc.errors import UserError
from recsvc.recommender.answer import Answering
from recsvc.recommender.api import RecQuery, RecResult, RecStats, WithoutModel
from recsvc.rules.spec import Rules


class PopularityRecommender(WithoutModel, Answering):
    """Most popular items first (ties: smaller item id first); thread-safe (read-only after construction)."""

    def __init__(
        self,
        counts: Mapping[int, float],
        *,
        max_k: int = 50,
        max_history: int = 200,
        semantic_ids: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        if not counts:
            raise UserError("popularity table is empty")
        bad = [item for item, count in counts.items() if not (count >= 0 and math.isfinite(count))]
        if bad:
            raise UserError(f"popularity counts must be finite and >= 0 (items {bad[:5]})")
        self.max_k = max_k
        self.max_history = max_history
        self._ranked: list[int] = sorted(counts, key=lambda item: (-counts[item], item))
        total = float(sum(counts.values())) or 1.0
        # an item never seen (count 0) gets the score of half an observation, so scores stay finite
        self._score = {item: math.log(max(float(counts[item]), 0.5) / total) for item in self._ranked}
        self._semantic_ids = {int(k): list(v) for k, v in (semantic_ids or {}).items()}

    @classmethod
    def from_histories(cls, histories: Iterable[Sequence[int]], **kwargs) -> PopularityRecommender:
        """Counts every interaction of every history (e.g. the training split)."""
        counts: Counter[int] = Counter()
        for history in histories:
            counts.update(int(item) for item in history)
        return cls(counts, **kwargs)

    @classmethod
    def from_json(cls, path: str | Path, **kwargs) -> PopularityRecommender:
        """Reads ``{"<item_id>": count, ...}`` (a JSON object)."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise UserError(f"{path}: expected a JSON object {{item_id: count}}")
        try:
            counts = {int(item): float(count) for item, count in raw.items()}
        except (TypeError, ValueError) as exc:
            raise UserError(f"{path}: item ids must be integers and counts numbers ({exc})") from exc
        return cls(counts, **kwargs)

    def known_item(self, item_id: int) -> bool:
        return item_id in self._score

    def semantic_id(self, item_id: int) -> list[str]:
        return list(self._semantic_ids.get(item_id, ()))

    def popular_items(self, k: int, exclude: Sequence[int] = (), rules: Rules | None = None) -> list[int]:
        excluded = set(exclude)
        out: list[int] = []
        for item in self._ranked:
            if len(out) >= k:
                break
            if item not in excluded:
                out.append(item)
        return out

    def score(self, item_id: int) -> float:
        """log(count / total) of a known item."""
        return self._score[item_id]

    def recommend(self, queries: Sequence[RecQuery]) -> list[RecResult]:
        results = []
        for query in queries:
            items = self.popular_items(query.k, query.exclude)
            results.append(
                RecResult(item_ids=items, scores=[self._score[i] for i in items], stats=RecStats())
            )
        return results
