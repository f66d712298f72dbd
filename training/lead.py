"""The model's lead over each baseline, with its noise: a paired bootstrap interval of the ratio of the means.

A table of means says, for instance, that the served model scores Recall@10 0.0290 where SASRec scores 0.0263
(1.10x). Whether such a lead is real, and whether it clears a line such as 1.1x, depends on how much the ratio
would move with another draw of users. Both lists are scored on the same users, so the comparison is paired:

- per user u, the model's metric m_u and the baseline's b_u (Recall@k or NDCG@k of each list);
- the mean paired difference mean(m - b) with its standard error;
- a 95% interval of the ratio mean(m) / mean(b): ``resamples`` resamples of the users with replacement (the same
  resample for both lists, a fixed seed), the 2.5% and 97.5% quantiles of the resampled ratios (percentile
  bootstrap). A resample where the baseline scores 0 is left out of the ratio's quantiles.

Worked example: m = [1, 0, 1, 0], b = [1, 0, 0, 0] -> ratio 2.0, difference 0.25 +- 0.25.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from recsvc.data.metrics import ndcg_at_k, recall_at_k
from recsvc.data.split import EvalUser

METRICS: dict[str, Callable[[Sequence[int], Sequence[int], int], float]] = {"recall": recall_at_k, "ndcg": ndcg_at_k}
Lists = Callable[[int], Mapping[int, Sequence[int]]]  # cutoff k -> {user id: ranked item ids} read at k


def per_user(lists: Mapping[int, Sequence[int]], users: Sequence[EvalUser], k: int, metric: str) -> np.ndarray:
    """The metric of each user's list at k -> [n users] float64 (users without targets are skipped)."""
    fn = METRICS[metric]
    return np.array([fn(list(lists.get(u.user_id, ()))[:k], u.targets, k) for u in users if u.targets],
                    dtype=np.float64)


def paired_lead(model: np.ndarray, base: np.ndarray, resamples: int = 2000, seed: int = 0
                ) -> dict[str, float | None]:
    """Model [n] against baseline [n], the same users in the same order -> ratio of means with its 95% interval
    (``ratio_lo``, ``ratio_hi``), mean paired difference and its standard error. An undefined ratio (a baseline
    scoring 0) or interval (fewer than 2 users) is None.

    >>> r = paired_lead(np.array([1., 0, 1, 0]), np.array([1., 0, 0, 0]), resamples=200)
    >>> r["ratio"], r["diff"], r["diff_se"]
    (2.0, 0.25, 0.25)
    """
    if model.shape != base.shape or model.ndim != 1:
        raise ValueError(f"paired metrics need two [n] arrays of one length, got {model.shape} and {base.shape}")
    n = len(model)
    diff = model - base
    out: dict[str, float | None] = {
        "users": float(n), "model": float(model.mean()) if n else 0.0, "baseline": float(base.mean()) if n else 0.0,
        "diff": float(diff.mean()) if n else 0.0, "diff_se": float(diff.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0}
    out["ratio"] = float(model.mean() / base.mean()) if n and base.mean() > 0 else None
    if n < 2 or resamples < 1:
        out["ratio_lo"] = out["ratio_hi"] = None
        return out
    rng = np.random.default_rng(seed)
    m_sum = np.empty(resamples)
    b_sum = np.empty(resamples)
    for start in range(0, resamples, 250):  # bounded memory: 250 x n indices at a time
        idx = rng.integers(0, n, size=(min(250, resamples - start), n))
        m_sum[start:start + len(idx)] = model[idx].sum(axis=1)
        b_sum[start:start + len(idx)] = base[idx].sum(axis=1)
    ok = b_sum > 0
    ratios = m_sum[ok] / b_sum[ok]
    if len(ratios):
        lo, hi = np.quantile(ratios, [0.025, 0.975])
        out["ratio_lo"], out["ratio_hi"] = float(lo), float(hi)
    else:
        out["ratio_lo"] = out["ratio_hi"] = None
    return out


def leads(model: Lists, baselines: Mapping[str, Lists], users: Sequence[EvalUser], ks: Sequence[int],
          resamples: int = 2000, seed: int = 0) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{baseline: {"recall@10": paired_lead(...), "ndcg@10": ..., ...}}`` for every baseline and cutoff."""
    out: dict[str, dict[str, dict[str, float | None]]] = {name: {} for name in baselines}
    for k in ks:
        mine = model(k)
        scored = {metric: per_user(mine, users, k, metric) for metric in METRICS}  # the model's, once per cutoff
        for name, lists in baselines.items():
            theirs = lists(k)
            for metric in METRICS:
                out[name][f"{metric}@{k}"] = paired_lead(scored[metric], per_user(theirs, users, k, metric),
                                                         resamples, seed)
    return out


def best_baseline(result: Mapping[str, object], key: str) -> str | None:
    """The baseline (plain, not ``+fresh``) with the highest ``key`` (e.g. "recall@10") in an evaluation result."""
    base = result.get("baselines") or {}
    assert isinstance(base, Mapping)
    plain = {name: r[key] for name, r in base.items() if "+" not in name and key in r}
    return max(plain, key=plain.__getitem__) if plain else None


def format_leads(result: Mapping[str, object], ks: Sequence[int]) -> str:
    """Lines such as ``lead over sasrec (best Recall@10): Recall@10 1.10x [1.02, 1.19], +0.0027 +- 0.0011``."""
    lead = result.get("lead") or {}
    assert isinstance(lead, Mapping)
    lines = []
    for k in ks:
        for metric, label in (("recall", "Recall"), ("ndcg", "NDCG")):
            key = f"{metric}@{k}"
            name = best_baseline(result, key)
            if name is None or name not in lead:
                continue
            r = lead[name][key]
            if r["ratio"] is None or r["ratio_lo"] is None:
                continue
            lines.append(f"lead over {name} (best {label}@{k} among the baselines): {label}@{k} {r['ratio']:.3f}x "
                         f"[{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}] (95% paired bootstrap), "
                         f"difference {r['diff']:+.4f} +- {r['diff_se']:.4f}")
    return "\n".join(lines)
