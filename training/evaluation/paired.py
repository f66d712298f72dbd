"""Paired comparisons of ranked lists on every user and on the cold / warm slices, kept per user for later pooling.

A *slice* is a set of users with their targets restricted (``recsvc.data.metrics.slice_users``): ``all`` (every
user with a target), ``cold`` (targets that are items nobody interacted with in the fitting period) and ``warm``
(the other targets). ``slice_scores`` gives each user's Recall@k / NDCG@k of one method on each slice;
``paired_slices`` compares two methods' scores user by user (``training.evaluation.lead.paired_lead``: ratio of means
with its 95% paired bootstrap interval, mean difference with its standard error).

``per_user_payload`` stores the scores in the eval JSON (``"per_user"``): the slices' user ids in order, and for
each method, slice and key the users with a non-zero score (``{"at": [positions], "value": [scores]}``; most
users score 0 at small cutoffs), so that ``recsvc eval summarize`` can resample users across several runs
(``training.evaluation.seeds``). ``scores_from_payload`` reads them back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from recsvc.data.metrics import slice_users
from recsvc.data.split import EvalUser
from training.evaluation.lead import Lists, paired_leads, per_user

SLICES = ("all", "cold", "warm")
Scores = dict[str, dict[str, np.ndarray]]  # slice -> "recall@10" -> [users of the slice]
Leads = dict[str, dict[str, dict[str, float | None]]]  # slice -> "recall@10" -> paired_lead


def slice_parts(users: Sequence[EvalUser], cold: set[int]) -> dict[str, list[EvalUser]]:
    """``{"all": ..., "cold": ..., "warm": ...}``: the users of each slice (those left with a target)."""
    return {"all": [u for u in users if u.targets], "cold": slice_users(users, cold, True),
            "warm": slice_users(users, cold, False)}


def slice_scores(lists: Lists, parts: Mapping[str, Sequence[EvalUser]], ks: Sequence[int]) -> Scores:
    """Each user's Recall@k and NDCG@k on each slice; ``lists(k)`` is read once per cutoff."""
    out: Scores = {name: {} for name in parts}
    for k in ks:
        at = lists(k)
        for name, users in parts.items():
            for metric in ("recall", "ndcg"):
                out[name][f"{metric}@{k}"] = per_user(at, users, k, metric)
    return out


def paired_slices(mine: Scores, theirs: Scores, resamples: int = 2000, seed: int = 0) -> Leads:
    """``{slice: {"recall@10": paired_lead, ...}}`` of two methods scored on the same slices."""
    return {name: paired_leads(values, theirs[name], resamples, seed) for name, values in mine.items()}


def pair_record(model: str, baseline: str, mine: Scores, theirs: Scores) -> dict[str, Any]:
    """One entry of the eval JSON's ``"paired"`` list: the two methods' names and their leads per slice."""
    return {"model": model, "baseline": baseline, "slices": paired_slices(mine, theirs)}


def find_pair(paired: Sequence[Mapping[str, Any]], model: str, baseline: str) -> Mapping[str, Any] | None:
    """The ``"paired"`` entry of ``model`` against ``baseline``, or None."""
    return next((r for r in paired if r["model"] == model and r["baseline"] == baseline), None)


def per_user_payload(parts: Mapping[str, Sequence[EvalUser]], scored: Mapping[str, Scores]) -> dict[str, Any]:
    """The JSON form of every method's per-user scores (sparse: the non-zero ones)."""
    def sparse(values: np.ndarray) -> dict[str, list]:
        at = np.flatnonzero(values)
        return {"at": at.tolist(), "value": values[at].tolist()}

    return {"users": {name: [u.user_id for u in users] for name, users in parts.items()},
            "scores": {method: {name: {key: sparse(v) for key, v in keys.items()} for name, keys in s.items()}
                       for method, s in scored.items()}}


def scores_from_payload(payload: Mapping[str, Any], method: str) -> Scores:
    """``per_user_payload``'s scores of one method back as arrays (zeros where nothing was stored)."""
    sizes = {name: len(ids) for name, ids in payload["users"].items()}
    out: Scores = {}
    for name, keys in payload["scores"][method].items():
        out[name] = {}
        for key, cell in keys.items():
            values = np.zeros(sizes[name])
            values[np.asarray(cell["at"], dtype=np.int64)] = np.asarray(cell["value"], dtype=np.float64)
            out[name][key] = values
    return out


def lead_cell(r: Mapping[str, float | None] | None) -> str:
    """``1.10x [0.95, 1.29]``; where the ratio is undefined (the second list scores 0), the difference with its
    standard error: ``+0.0182 +- 0.0042``; ``-`` without users."""
    if not r or not r.get("users"):
        return "-"
    if r.get("ratio") is not None and r.get("ratio_lo") is not None:
        return f"{r['ratio']:.3f}x [{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]"
    return f"{r['diff']:+.4f} +- {r['diff_se']:.4f}"
