"""The tails of the lists given to fresh items (``FreshItems.merge``), a list stage. Requests with rules are
left as decoded (fresh items carry no attributes to check them against), as are lists of one item; without
fresh slots every list is left as decoded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from recsvc.content.fresh import FreshItems
from recsvc.recommender.api import RecQuery, RecResult
from recsvc.recommender.stages.scope import Scope


class FreshTails:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        fresh = scope.parts.fresh
        self.fresh: FreshItems | None = fresh if fresh is not None and fresh.settings.slots else None

    def __call__(self, queries: Sequence[RecQuery], results: list[RecResult]) -> list[RecResult]:
        fresh = self.fresh
        if fresh is None:
            return results
        idx = [i for i, q in enumerate(queries) if q.rules is None and q.k > 1]
        if not idx:
            return results
        excluded = self.scope.excluded([queries[i] for i in idx])
        cands = fresh.candidates([queries[i].history for i in idx], fresh.settings.slots, excluded)
        out = list(results)
        for i, cand in zip(idx, cands, strict=True):
            res, sims = results[i], dict(cand)
            items = fresh.merge(res.item_ids, cand, queries[i].k)
            model_scores = dict(zip(res.item_ids, res.scores, strict=True))
            n_fresh = sum(1 for item in items if item in sims and item not in model_scores)
            scores = [model_scores[item] if item in model_scores else sims[item] for item in items]
            out[i] = replace(res, item_ids=items, scores=scores, fresh=n_fresh)
        return out
