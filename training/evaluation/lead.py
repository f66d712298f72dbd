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


def resampled_sums(arrays: Sequence[np.ndarray], resamples: int, seed: int = 0) -> np.ndarray:
    """Arrays [n] of the same n users -> [len(arrays), resamples]: each array's sum over the same ``resamples``
    draws of n users with replacement (the draws depend on n, ``resamples`` and ``seed`` only; each draw is
    counted per user, so many arrays cost one product)."""
    values = np.stack([np.asarray(a, dtype=np.float64) for a in arrays], axis=1)  # [n, A]
    n = len(values)
    rng = np.random.default_rng(seed)
    sums = np.empty((values.shape[1], resamples))
    for start in range(0, resamples, 250):  # bounded memory: 250 x n draws at a time
        rows = min(250, resamples - start)
        idx = rng.integers(0, n, size=(rows, n)) + n * np.arange(rows)[:, None]
        counts = np.bincount(idx.ravel(), minlength=rows * n).reshape(rows, n).astype(np.float64)
        sums[:, start:start + rows] = (counts @ values).T
    return sums


def _interval(values: np.ndarray) -> tuple[float | None, float | None]:
    """The 2.5% and 97.5% quantiles (a percentile bootstrap's 95% interval); None, None without values."""
    if not len(values):
        return None, None
    lo, hi = np.quantile(values, [0.025, 0.975])
    return float(lo), float(hi)


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
    m_sum, b_sum = resampled_sums((model, base), resamples, seed)
    ok = b_sum > 0
    ratios = m_sum[ok] / b_sum[ok]
    out["ratio_lo"], out["ratio_hi"] = _interval(ratios)
    return out


def mean_ratio(pairs: Sequence[tuple[np.ndarray, np.ndarray]], resamples: int = 2000, seed: int = 0
               ) -> dict[str, float | None]:
    """Several (model [n], baseline [n]) pairs over the SAME n users (e.g. one per training seed) -> the mean of
    their ratios of means, with a 95% interval from resampling the users jointly: each resample draws n users
    once and computes every pair's ratio on that draw, and the interval is the percentiles of the mean of those
    ratios. The users' draw is shared because the pairs were scored on the same users, so their errors move
    together; the interval covers which users were drawn, not which training seeds (their spread is each pair's
    own ratio). A resample where some baseline scores 0 is left out.

    >>> x, y = np.array([1., 0, 1, 0]), np.array([1., 0, 0, 1])
    >>> mean_ratio([(x, y), (x, x)], resamples=100)["ratio"]
    1.0
    """
    if not pairs or any(m.shape != pairs[0][0].shape or b.shape != m.shape or m.ndim != 1 for m, b in pairs):
        raise ValueError("mean_ratio needs [n] arrays of one length, paired")
    n = len(pairs[0][0])
    ratios = [float(m.mean() / b.mean()) if n and b.mean() > 0 else None for m, b in pairs]
    out: dict[str, float | None] = {
        "users": float(n), "model": float(np.mean([m.mean() for m, _ in pairs])) if n else 0.0,
        "baseline": float(np.mean([b.mean() for _, b in pairs])) if n else 0.0,
        "ratio": None, "ratio_lo": None, "ratio_hi": None}
    if all(r is not None for r in ratios):
        out["ratio"] = float(np.mean([r for r in ratios if r is not None]))
    if n < 2 or resamples < 1:
        return out
    sums = resampled_sums([a for pair in pairs for a in pair], resamples, seed).reshape(len(pairs), 2, resamples)
    ok = (sums[:, 1] > 0).all(axis=0)
    out["ratio_lo"], out["ratio_hi"] = _interval((sums[:, 0, ok] / sums[:, 1, ok]).mean(axis=0))
    return out


def scores(lists: Lists, users: Sequence[EvalUser], ks: Sequence[int]) -> dict[str, np.ndarray]:
    """``{"recall@10": [n], "ndcg@10": [n], ...}``: each user's metric at every cutoff (``per_user``)."""
    out: dict[str, np.ndarray] = {}
    for k in ks:
        at = lists(k)
        for metric in METRICS:
            out[f"{metric}@{k}"] = per_user(at, users, k, metric)
    return out


def paired_leads(mine: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray], resamples: int = 2000,
                 seed: int = 0) -> dict[str, dict[str, float | None]]:
    """``paired_lead`` of every key (``"recall@10"``, ...) of two ``scores`` of the same users."""
    return {key: paired_lead(values, theirs[key], resamples, seed) for key, values in mine.items()}


def leads(model: Lists, baselines: Mapping[str, Lists], users: Sequence[EvalUser], ks: Sequence[int],
          resamples: int = 2000, seed: int = 0) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{baseline: {"recall@10": paired_lead(...), "ndcg@10": ..., ...}}`` for every baseline and cutoff."""
    mine = scores(model, users, ks)  # the model's, once
    return {name: paired_leads(mine, scores(lists, users, ks), resamples, seed) for name, lists in baselines.items()}


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
