"""Requests ranked by the bundle's prior alone: what a bundle serves when validation found the fused target worse.

``recsvc tune mix`` compares, on the same validation users, the best fused search (target + w * log prior) with
the best ranking of the prior on its own (the transition counts mixed with SASRec; mix 1 is SASRec itself). A
target trained too briefly for its catalog can lose to the prior it is fused with; the tuning then marks the
prior ``alone`` (``MixSettings.alone``) and every request of the bundle is answered here: the items of highest
P(item | history), best first, without the request's exclusions (and its history when the service excludes
it). Rules: allow / deny filters and caps apply as they do to popular items; boosts need the target's scores
and are not applied. The service reports such a request as plain decoding with a fallback reason saying that
the prior ranked it; no target forward runs.

Shapes: B requests, n catalog items (the prior's columns are the catalog's item rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from recsvc.priors.mixed import MixedPrior
from recsvc.priors.transition import TransitionPrior
from recsvc.recommender.api import Decoding, RecQuery, RecResult, RecStats
from recsvc.rules.catalog import RuleCatalog
from recsvc.rules.greedy import greedy_pick

PRIOR_RANKED = "the bundle ranks by its prior alone (recsvc tune mix found it better than the fused target on " \
               "validation)"


def ranks_alone(prior: TransitionPrior | MixedPrior | None) -> bool:
    """Whether ``prior`` answers requests on its own instead of being fused into the target's search."""
    return isinstance(prior, MixedPrior) and prior.mix.alone


def prior_ranked(
    prior: TransitionPrior | MixedPrior,
    queries: Sequence[RecQuery],
    excluded: Sequence[Sequence[int]],  # per query: items never returned (its exclusions, and history if excluded)
    catalog: Callable[[], RuleCatalog],  # the item attributes, for queries with filters or caps (raises without)
) -> list[RecResult]:
    """Each query's top k items by P(item | history), ties to the lower item id; scores are log P(item)."""
    item_ids = np.asarray(prior.item_ids)
    p = np.asarray(prior.probs([q.history for q in queries]), dtype=np.float32)  # [B, n]
    out = []
    for b, q in enumerate(queries):
        order = np.lexsort((item_ids, -p[b]))  # [n] catalog rows, best first
        order = order[p[b, order] > 0]  # items the prior rules out are never returned
        rules = q.rules
        if rules is not None and (rules.has_filters or rules.caps):
            cat = catalog()
            rows = order[cat.alive_rows(rules, excluded[b])[order]]
            rows = rows[greedy_pick(rows, cat.cap_spec(rules), q.k)]
        else:
            ex = {int(i) for i in excluded[b]}
            rows = np.array([r for r in order[: q.k + len(ex)] if int(item_ids[r]) not in ex][: q.k], dtype=np.int64)
        scores = np.log(p[b, rows]).astype(np.float64)
        out.append(RecResult(item_ids=[int(i) for i in item_ids[rows]], scores=scores.tolist(), stats=RecStats(),
                             decoding=Decoding("plain", 0, fallback=PRIOR_RANKED)))
    return out
