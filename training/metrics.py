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
from collections.abc import Iterable, Mapping, Sequence

from training.data.dataset import EvalUser

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
