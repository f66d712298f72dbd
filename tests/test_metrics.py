"""Recall@K / NDCG@K per the README protocol, and the popularity baseline."""

from __future__ import annotations

import math

import pytest

from recsvc.data.metrics import evaluate_rankings, ndcg_at_k, popularity_rankings, recall_at_k
from recsvc.data.split import EvalUser

L2 = math.log2


@pytest.mark.parametrize(
    ("ranked", "targets", "k", "recall", "ndcg"),
    [
        ([1, 2, 3], [1], 3, 1.0, 1.0),  # hit at rank 1
        ([2, 1, 3], [1], 3, 1.0, 1 / L2(3)),  # hit at rank 2
        ([2, 3, 1], [1], 2, 0.0, 0.0),  # hit beyond K
        ([5, 1, 9], [1, 2], 2, 0.5, (1 / L2(3)) / (1 + 1 / L2(3))),  # 1 of 2 targets, IDCG over 2
        ([1, 2], [1, 2, 3, 4], 2, 0.5, 1.0),  # IDCG over min(|targets|, K) = 2 positions
        ([], [1], 10, 0.0, 0.0),  # nothing recommended
        ([1, 1, 1], [1, 2], 3, 0.5, 1 / (1 + 1 / L2(3))),  # a repeated item counts once
    ],
)
def test_recall_ndcg(ranked, targets, k, recall, ndcg) -> None:
    assert recall_at_k(ranked, targets, k) == pytest.approx(recall)
    assert ndcg_at_k(ranked, targets, k) == pytest.approx(ndcg)


def test_evaluate_rankings_averages_over_users_with_targets() -> None:
    users = [EvalUser(1, [7], [1]), EvalUser(2, [8], [2, 3]), EvalUser(3, [9], [])]
    out = evaluate_rankings({1: [1, 5], 2: [4, 4]}, users, ks=(1, 2))
    assert out["users"] == 2
    assert out["recall@1"] == pytest.approx(0.5) and out["recall@2"] == pytest.approx(0.5)
    assert out["ndcg@2"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        recall_at_k([1], [], 5)


def test_popularity_rankings() -> None:
    pop = {1: 5, 2: 9, 3: 5, 4: 1}
    users = [EvalUser(1, [2], [3]), EvalUser(2, [], [4])]
    assert popularity_rankings(pop, users, k=3) == {1: [2, 1, 3], 2: [2, 1, 3]}
    assert popularity_rankings(pop, users, k=3, exclude_history=True)[1] == [1, 3, 4]
    out = evaluate_rankings(popularity_rankings(pop, users, k=3), users, ks=(3,))
    assert out["recall@3"] == pytest.approx(0.5)
