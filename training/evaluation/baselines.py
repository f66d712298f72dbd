"""Baselines beside the model in ``recsvc eval``: fit each under a protocol, rank the same users, same metrics.

``evaluate_baselines`` -> ``{"protocol": p, "baselines": {name: {"recall@K": .., "ndcg@K": .., "users": n,
"fit_seconds": s, "fit_on": "train" | "train+valid", "rank_seconds": s, ...}}}``. Every ranking goes through
``recsvc.data.metrics.evaluate_rankings`` with the users (and the history exclusion) the model is scored on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recsvc.data.metrics import score_lists
from recsvc.data.split import EvalUser, SplitData
from training.baselines.base import check_protocol, fit_period
from training.baselines.registry import fit_baseline
from training.evaluation.fresh import fresh_candidates_by_user, fresh_lists


def evaluate_baselines(
    data: SplitData, split: str, ks: Sequence[int], names: Sequence[str], protocol: str = "paper",
    users: Sequence[EvalUser] | None = None, exclude_history: bool = False, *, sasrec_settings=None,
    cache_dir: str | Path | None = None, progress: bool = True, cold: set[int] | None = None,
    fresh: Any = None, lists_out: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit ``names`` on the protocol's fit period for ``split`` and score them on ``users`` (default: all).

    ``cold`` (items never interacted with in the fitting period): each baseline also gets ``"cold"`` /
    ``"warm"`` slices. ``fresh`` (a ``recsvc.content.fresh.FreshItems`` with slots > 0): each baseline is scored a
    second time as ``NAME+fresh``, its lists' tails given to the same fresh items as the model's. ``lists_out``: filled
    with each scored name's lists (cutoff k -> {user id: ranked items}), for paired comparisons
    (training.evaluation.lead)."""
    check_protocol(protocol)
    fit_on = fit_period(protocol, split)
    users = list(users) if users is not None else data.eval_users(split)
    with_fresh = fresh is not None and fresh.settings.slots > 0
    # the fresh candidates depend on the users only: once for every baseline
    cands = fresh_candidates_by_user(fresh, users, fresh.settings.slots, exclude_history) if with_fresh else None
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        baseline = fit_baseline(name, data, fit_on, sasrec_settings=sasrec_settings, cache_dir=cache_dir,
                                progress=progress)
        start = time.perf_counter()
        rankings = baseline.rank(users, max(ks), exclude_history)
        rank_s = time.perf_counter() - start
        if lists_out is not None:
            lists_out[name] = lambda k, r=rankings: r
        out[name] = {
            **score_lists(lambda k, r=rankings: r, users, ks, cold), "fit_seconds": round(baseline.fit_seconds, 2),
            "fit_on": baseline.fit_on, "rank_seconds": round(rank_s, 2),
            **({"info": {k: v for k, v in baseline.info.items() if k != "history"}} if baseline.info else {}),
        }
        if with_fresh:
            with_slots = fresh_lists(fresh, rankings, users, exclude_history, cands)
            if lists_out is not None:
                lists_out[f"{name}+fresh"] = with_slots
            out[f"{name}+fresh"] = {**score_lists(with_slots, users, ks, cold), "fit_seconds": out[name]["fit_seconds"],
                                    "fit_on": baseline.fit_on, "rank_seconds": round(rank_s, 2)}
    return {"protocol": protocol, "baselines": out}


def _slice_cells(r: dict[str, Any], k: int) -> list[str]:
    return [f"{r[part][f'recall@{k}']:.4f} ({int(r[part]['users'])})" if part in r else "-"
            for part in ("cold", "warm")]


def format_table(result: dict[str, Any]) -> str:
    """Markdown table: a row for the model (when evaluated) and each baseline; Recall@K / NDCG@K, the cold /
    warm slices' Recall@10 (or at the largest K; users in the slice in brackets), fit seconds."""
    ks = result["ks"]
    sk = 10 if 10 in ks else max(ks)
    head = (["", "fit on"] + [f"{m}@{k}" for k in ks for m in ("Recall", "NDCG")]
            + [f"cold Recall@{sk}", f"warm Recall@{sk}", "fit s"])
    rows: list[list[str]] = []
    # the model as served, without its fresh slots, and the prior fused into its search read alone
    for key, label in (("model", "model"), ("model_without_fresh", "model, no fresh slots"),
                       ("prior_alone_fresh", "served prior alone + fresh slots"),
                       ("prior_alone", "served prior alone")):
        if result.get(key):
            rows.append([label, str(result.get("model_fit_on", "bundle"))]
                        + [f"{result[key][f'{m}@{k}']:.4f}" for k in ks for m in ("recall", "ndcg")]
                        + _slice_cells(result[key], sk) + ["-"])
    for name, r in result.get("baselines", {}).items():
        info = r.get("info", {})
        cached = " (cached)" if info.get("cached") else " (selection cached)" if info.get("selection_cached") else ""
        rows.append([name, r["fit_on"]] + [f"{r[f'{m}@{k}']:.4f}" for k in ks for m in ("recall", "ndcg")]
                    + _slice_cells(r, sk) + [f"{r['fit_seconds']:.1f}{cached}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
