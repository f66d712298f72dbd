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
from recsvc.model.sequence_prior import MixedPrior
from recsvc.model.transition import TransitionPrior

RANK_BATCH = 512  # users per dense [B, n] probability block


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
        p = np.array(prior.probs([u.history for u in chunk]), dtype=np.float32)  # [B, n] (a copy)
        for b, user in enumerate(chunk):
            if exclude_history:
                p[b, [row_of[int(i)] for i in user.history if int(i) in row_of]] = -1.0
            order = np.lexsort((item_ids, -p[b]))[:k]
            out[user.user_id] = [int(item_ids[r]) for r in order if p[b, r] >= 0]
    return out
