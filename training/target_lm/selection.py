"""Choosing the epoch on validation: per-user scores, their standard errors, and the rule that picks the epoch.

A validation pass scores every user (Recall@10 of the target's beam search, or minus the loss of each validation
example). The mean is the epoch's score; its standard error, and the paired difference of two epochs (the same
users, so most of the spread between users cancels), say whether two epochs differ beyond noise.

Rules (``select_epoch``):

- ``best``: the epoch with the highest mean (the first of equal ones).
- ``within-se``: the LATEST epoch whose mean is within one paired standard error of the best epoch's
  (``best - mean <= se(best - epoch)``). An epoch that is not distinguishable from the best goes to the later one:
  further along the schedule, where the learning rate has annealed and the validation loss is usually lowest.
  When an epoch has no per-user values (an evaluator that returns means only) its standard error is 0 and the rule
  is ``best`` with ties going to the later epoch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SELECT_RULES = ("within-se", "best")
PER_USER = "per_user"  # an evaluator's optional key: {metric: [one value per user, in a fixed user order]}


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean); the error is 0 for fewer than 2 values.

    >>> [round(v, 4) for v in mean_se([0.0, 1.0, 0.0, 1.0])]
    [0.5, 0.2887]
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), 0.0
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0
    return float(x.mean()), se


def paired_difference(a: Sequence[float] | None, b: Sequence[float] | None, mean_a: float, mean_b: float
                      ) -> tuple[float, float]:
    """(mean of a - b, its standard error) over the same users; without per-user values on both sides (or of
    different lengths): (mean_a - mean_b, 0)."""
    if a is None or b is None or len(a) != len(b) or len(a) == 0:
        return mean_a - mean_b, 0.0
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0
    return float(d.mean()), se


def best_index(means: Sequence[float]) -> int:
    """The first index of the highest mean."""
    if not means:
        raise ValueError("no epochs to choose from")
    return max(range(len(means)), key=lambda i: (means[i], -i))


def select_epoch(means: Sequence[float], per_user: Sequence[Sequence[float] | None], rule: str = "within-se") -> int:
    """The index of the chosen epoch (0-based) under ``rule`` (module docstring); higher means are better.

    >>> select_epoch([0.1, 0.3, 0.2], [None, None, None], "best")
    1
    >>> select_epoch([0.1, 0.3, 0.3], [None, None, None], "within-se")  # a tie goes to the later epoch
    2
    """
    if rule not in SELECT_RULES:
        raise ValueError(f"selection rule must be one of {', '.join(SELECT_RULES)}, not {rule!r}")
    if len(per_user) != len(means):
        raise ValueError(f"{len(means)} means but {len(per_user)} per-user lists")
    top = best_index(means)
    if rule == "best":
        return top
    for i in range(len(means) - 1, -1, -1):
        diff, se = paired_difference(per_user[top], per_user[i], means[top], means[i])
        if diff <= se:
            return i
    return top  # unreachable: the best epoch is within its own error


def selection_table(epochs: Sequence[float], means: Sequence[float], per_user: Sequence[Sequence[float] | None],
                    rule: str) -> list[dict[str, Any]]:
    """One row per evaluated epoch: its mean and standard error, the paired difference to the best epoch with its
    standard error, and which epoch is the best and which the rule chose (the record of training.json)."""
    if not means:
        return []
    top, chosen = best_index(means), select_epoch(means, per_user, rule)
    rows = []
    for i, (epoch, mean) in enumerate(zip(epochs, means, strict=True)):
        se = mean_se(per_user[i])[1] if per_user[i] is not None else None
        diff, diff_se = paired_difference(per_user[i], per_user[top], mean, means[top])
        rows.append({"epoch": epoch, "mean": mean, "se": se, "vs_best": diff,
                     "vs_best_se": diff_se if per_user[i] is not None and per_user[top] is not None else None,
                     "best": i == top, "chosen": i == chosen})
    return rows


def per_user_metrics(rankings: dict[int, Sequence[int]], users: Sequence[Any], k: int) -> dict[str, list[float]]:
    """{"recall@k": [...], "ndcg@k": [...]}: one value per user with targets, in ``users``' order (a user missing
    from ``rankings`` scores 0, as ``recsvc.data.metrics.evaluate_rankings`` counts them)."""
    from training.evaluation.lead import METRICS, per_user

    return {f"{metric}@{k}": per_user(rankings, users, k, metric).tolist() for metric in METRICS}


def make_selection_evaluator(builder, data, split: str = "valid", k: int = 10, max_users: int | None = None,
                             batch_size: int = 64, seed: int = 0, prior=None) -> Callable[[Any], dict[str, Any]]:
    """model -> {"recall@k": mean, "ndcg@k": mean, "users": n, "per_user": {"recall@k": [...], "ndcg@k": [...]}}:
    the target's plain constrained beam search (as ``training.evaluation.evaluate.make_evaluator`` ranks) on the
    validation users (every one by default; ``max_users``: a fixed seeded sample), with the per-user values the rule
    needs; ``prior`` (a ``TransitionPrior`` with its weight) fused into the search when given (a target trained
    with the prior inside its loss is chosen as it will be served: fused)."""
    from recsvc.data.sampling import sample_users
    from training.evaluation.ranking import model_ranker

    users = [u for u in sample_users(data.eval_users(split), max_users, seed) if u.targets]
    rank = model_ranker(builder, users, k, batch_size, prior=prior)

    def evaluate(model: Any) -> dict[str, Any]:
        values = per_user_metrics(rank(model), users, k)
        out: dict[str, Any] = {name: float(np.mean(v)) if v else 0.0 for name, v in values.items()}
        out["users"] = float(len(users))
        out[PER_USER] = values
        return out

    return evaluate
