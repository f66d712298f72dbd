"""The served prior alone as a ranker: the item distribution fused into the target's beam search (the transition
prior, mixed with SASRec when the bundle has a mix), read directly as a top-k list.

``recsvc eval`` reports it beside the served target so that the table says what the generative model adds on
top of the distribution it is fused with: the served target against this ranking, with the same history
exclusion and the same fresh-item slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recsvc.data.split import EvalUser
from recsvc.priors.mixed import MixedPrior
from recsvc.priors.transition import TransitionPrior, top_items

RANK_BATCH = 512  # users per dense [B, n] probability block (B * 12k floats on Beauty = 25 MB)


def prior_rankings(prior: TransitionPrior | MixedPrior, users: Sequence[EvalUser], k: int,
                   exclude_history: bool = False) -> dict[int, list[int]]:
    """user id -> the ``k`` catalog items of highest P(item | history), best first (ties: lower item id); with
    ``exclude_history`` never one of the user's history items."""
    item_ids = np.asarray(prior.item_ids)
    row_of = {int(item): r for r, item in enumerate(item_ids)}
    out: dict[int, list[int]] = {}
    users = list(users)
    for lo in range(0, len(users), RANK_BATCH):
        chunk = users[lo: lo + RANK_BATCH]
        histories = [u.history for u in chunk]
        p = np.array(prior.probs(histories), dtype=np.float32)  # [B, n] (a copy: exclusions overwrite it)
        ranked = top_items(p, item_ids, row_of, k, histories if exclude_history else None)
        out.update({u.user_id: r for u, r in zip(chunk, ranked, strict=True)})
    return out
