"""The served prior read alone (``training.baselines.prior_alone``): the prior's own top-k, ties to the lower item id,
history items dropped when asked; a mixed prior ranks by its mixture."""

from __future__ import annotations

import numpy as np

from recsvc.data.split import EvalUser
from recsvc.priors.transition import PriorSettings, TransitionPrior
from training.baselines.prior_alone import prior_rankings

SEQS = [[1, 2, 3], [1, 2, 4], [2, 3, 1], [5, 1, 2], [3, 2, 1]]
ITEMS = [1, 2, 3, 4, 5, 6]


def _users(*histories: list[int]) -> list[EvalUser]:
    return [EvalUser(user_id=u, history=list(h), targets=[6]) for u, h in enumerate(histories)]


def test_matches_the_priors_own_ranking_with_and_without_exclusion() -> None:
    prior = TransitionPrior.fit(SEQS, ITEMS, PriorSettings(window=1, beta=1.0))
    users = _users([1], [2, 1], [4], [9])  # 9: unknown item -> popularity
    got = prior_rankings(prior, users, 3)
    want = prior.rank([u.history for u in users], 3)
    assert got == {u.user_id: w for u, w in zip(users, want, strict=True)}
    assert got[0][0] == 2  # 1 -> 2 three times out of four
    excl = prior_rankings(prior, users, 3, exclude_history=True)
    assert excl == {u.user_id: w for u, w in zip(users, prior.rank([u.history for u in users], 3,
                                                                   [u.history for u in users]), strict=True)}
    assert all(not set(excl[u.user_id]) & set(u.history) for u in users)


class _Fixed:
    """A prior with given probabilities (what ``MixedPrior`` offers: item_ids and probs)."""

    item_ids = np.array([10, 20, 30, 40])

    def probs(self, histories):
        return np.tile(np.array([0.1, 0.4, 0.1, 0.4], dtype=np.float32), (len(histories), 1))


def test_ties_go_to_the_lower_item_id_and_k_is_respected() -> None:
    got = prior_rankings(_Fixed(), _users([10], [40]), 3)  # type: ignore[arg-type]
    assert got[0] == [20, 40, 10]
    assert prior_rankings(_Fixed(), _users([40]), 2, exclude_history=True)[0] == [20, 10]  # type: ignore[arg-type]


def test_top_items_equals_a_full_sort_ties_and_exclusions_included() -> None:
    """The partial sort (each row's items at or above its k-th value, then sorted) lists what sorting the whole
    row by (-p, item id) lists first, on rows full of ties, with exclusions, for k from 0 past the catalog."""
    from recsvc.priors.transition import top_items

    rng = np.random.default_rng(0)
    for case in range(200):
        n, rows, k = int(rng.integers(1, 40)), int(rng.integers(1, 5)), int(rng.integers(0, 45))
        p = rng.integers(0, 4, size=(rows, n)).astype(np.float32) / 4  # four values: many ties
        ids = rng.permutation(1000)[:n]
        row_of = {int(i): r for r, i in enumerate(ids)}
        exclude = [[*rng.choice(ids, size=min(n, 3), replace=False).tolist(), 5000] for _ in range(rows)] \
            if case % 2 else None
        q = p.copy()
        if exclude is not None:
            for b in range(rows):
                q[b, [row_of[i] for i in exclude[b] if i in row_of]] = -1.0
        full = [[int(ids[r]) for r in np.lexsort((ids, -q[b]))[:k] if q[b, r] >= 0] for b in range(rows)]
        assert top_items(p, ids, row_of, k, exclude) == full
