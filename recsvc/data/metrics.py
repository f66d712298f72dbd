"""Offline ranking metrics (data/amazon-beauty/README.md protocol) and a popularity baseline.

- Recall@K = |top-K ∩ targets| / |targets|
- NDCG@K = DCG@K / IDCG@K, DCG@K = sum over hits at rank r (1-based) of 1 / log2(r + 1), IDCG over
  min(|targets|, K) positions.
- Both averaged over users with >= 1 target; a user missing from ``rankings`` counts as 0.

>>> recall_at_k([5, 1, 9], {1, 2}, 2), round(ndcg_at_k([5, 1, 9], {1, 2}, 2), 4)
(0.5, 0.3869)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from recsvc.data.split import EvalUser

DEFAULT_KS = (5, 10, 20)


def standard_error(xs: Sequence[float]) -> float:
    """Standard error of the mean of ``xs`` (sample standard deviation / sqrt(n)); 0 for fewer than 2 values."""
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0


def recall_at_k(ranked: Sequence[int], targets: Iterable[int], k: int) -> float:
    targets = set(targets)
    if not targets:
        raise ValueError("recall of a user without targets is undefined")
    return len(set(ranked[:k]) & targets) / len(targets)


def ndcg_at_k(ranked: Sequence[int], targets: Iterable[int], k: int) -> float:
    targets = set(targets)
    if not targets:
        raise ValueError("ndcg of a user without targets is undefined")
    seen: set[int] = set()
    dcg = 0.0
    for rank, item in enumerate(ranked[:k], start=1):
        if item in targets and item not in seen:  # a repeated item earns once
            dcg += 1.0 / math.log2(rank + 1)
        seen.add(item)
    idcg = sum(1.0 / math.log2(r + 1) for r in range(1, min(len(targets), k) + 1))
    return dcg / idcg


def evaluate_rankings(
    rankings: Mapping[int, Sequence[int]], users: Sequence[EvalUser], ks: Sequence[int] = DEFAULT_KS
) -> dict[str, float]:
    """``{"recall@5": .., "ndcg@5": .., ..., "users": n}`` averaged over users with >= 1 target."""
    users = [u for u in users if u.targets]
    out: dict[str, float] = {}
    for k in ks:
        rec = ndcg = 0.0
        for u in users:
            ranked = list(rankings.get(u.user_id, ()))
            rec += recall_at_k(ranked, u.targets, k)
            ndcg += ndcg_at_k(ranked, u.targets, k)
        out[f"recall@{k}"] = rec / len(users) if users else 0.0
        out[f"ndcg@{k}"] = ndcg / len(users) if users else 0.0
    out["users"] = float(len(users))
    return out


def popularity_rankings(
    popularity: Mapping[int, int], users: Sequence[EvalUser], k: int = max(DEFAULT_KS),
    exclude_history: bool = False,
) -> dict[int, list[int]]:
    """Most popular items first (ties: smaller id), optionally without each user's history items."""
    order = sorted(popularity, key=lambda i: (-popularity[i], i))
    out: dict[int, list[int]] = {}
    for u in users:
        if not exclude_history:
            out[u.user_id] = order[:k]
            continue
        seen = set(u.history)
        ranked: list[int] = []
        for item in order:
            if item not in seen:
                ranked.append(item)
                if len(ranked) == k:
                    break
        out[u.user_id] = ranked
    return out


def slice_users(users: Sequence[EvalUser], items: set[int], inside: bool) -> list[EvalUser]:
    """The users with their targets restricted to ``items`` (inside) or to the rest; users left without targets
    are dropped. The cold slice is ``slice_users(users, cold, True)``, the warm one ``(users, cold, False)``.

    >>> u = EvalUser(1, [5], [7, 8])
    >>> [x.targets for x in slice_users([u], {8}, True)], [x.targets for x in slice_users([u], {8}, False)]
    ([[8]], [[7]])
    """
    out = []
    for u in users:
        kept = [t for t in u.targets if (t in items) == inside]
        if kept:
            out.append(EvalUser(u.user_id, u.history, kept))
    return out


def evaluate_slices(
    rankings: Mapping[int, Sequence[int]], users: Sequence[EvalUser], ks: Sequence[int], cold: set[int]
) -> dict[str, dict[str, float]]:
    """``{"cold": metrics, "warm": metrics}``: Recall / NDCG on the targets that are cold items (never
    interacted with in the fitting period) and on the others, each averaged over the users with >= 1 such target.
    The ranking is the same full list; only the targets are split."""
    return {"cold": evaluate_rankings(rankings, slice_users(users, cold, True), ks),
            "warm": evaluate_rankings(rankings, slice_users(users, cold, False), ks)}


def score_lists(
    lists_at: Callable[[int], Mapping[int, Sequence[int]]], users: Sequence[EvalUser], ks: Sequence[int],
    cold: set[int] | None = None,
) -> dict[str, object]:
    """Metrics when the list depends on the cutoff (fresh items take the tail of each top-k): ``lists_at(k)``
    gives the rankings read at k. -> evaluate_rankings' keys, plus ``"cold"`` / ``"warm"`` slices when ``cold``
    is given."""
    out: dict[str, object] = {}
    sliced: dict[str, dict[str, float]] = {"cold": {}, "warm": {}}
    for k in ks:
        lists = lists_at(k)
        out.update(evaluate_rankings(lists, users, (k,)))
        if cold is not None:
            for name, part in evaluate_slices(lists, users, (k,), cold).items():
                sliced[name].update(part)
    if cold is not None:
        out.update(sliced)
    return out
