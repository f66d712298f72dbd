"""Popularity: every user gets the most-interacted items of the fit period.

    score(j) = count(j) = number of interactions with item j in the fitted sequences

Ties go to the smaller item id (``recsvc.data.metrics.popularity_rankings``, the ranking the model is compared
with since the first ``recsvc eval``); items nobody interacted with are never recommended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from recsvc.data.metrics import popularity_rankings
from recsvc.data.split import EvalUser, SplitData
from training.baselines.base import Baseline, check_fit_on, fit_sequences


class PopularityBaseline(Baseline):
    name = "popularity"

    def __init__(self, counts: Mapping[int, int], fit_on: str = "train") -> None:
        super().__init__()
        self.counts = dict(counts)  # item_id -> interactions in the fit period
        self.fit_on = check_fit_on(fit_on)
        self.info = {"items_seen": len(self.counts), "interactions": int(sum(self.counts.values()))}

    @classmethod
    def fit(cls, data: SplitData, fit_on: str = "train") -> PopularityBaseline:
        counts: Counter[int] = Counter()
        for seq in fit_sequences(data, fit_on).values():
            counts.update(seq)
        return cls(counts, fit_on)

    def rank(self, users: Sequence[EvalUser], k: int, exclude_history: bool = False) -> dict[int, list[int]]:
        return popularity_rankings(self.counts, users, k, exclude_history)
