"""Baselines beside the model in ``recsvc eval``: fit each under a protocol, rank the same users, same metrics.

``evaluate_baselines`` -> ``{"protocol": p, "baselines": {name: {"recall@K": .., "ndcg@K": .., "users": n,
"fit_seconds": s, "fit_on": "train" | "train+valid", "rank_seconds": s, ...}}}``. Every ranking goes through
``training.metrics.evaluate_rankings`` with the users (and the history exclusion) the model is scored on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.baselines.base import check_protocol, fit_period
from training.baselines.registry import fit_baseline
from training.data.dataset import EvalUser, SplitData
from training.metrics import evaluate_rankings


def sample_users(users: Sequence[EvalUser], max_users: int | None, seed: int = 0) -> list[EvalUser]:
    """A fixed random sample of ``max_users`` users (sorted by id); the same draw as
    ``training.evaluate.sample_users`` (repeated here so ``--baselines-only`` never imports the engine)."""
    users = list(users)
    if max_users is not None and len(users) > max_users:
        users = sorted(random.Random(seed).sample(users, max_users), key=lambda u: u.user_id)
    return users


def evaluate_baselines(
    data: SplitData, split: str, ks: Sequence[int], names: Sequence[str], protocol: str = "paper",
    users: Sequence[EvalUser] | None = None, exclude_history: bool = False, *, sasrec_settings=None,
    cache_dir: str | Path | None = None, progress: bool = True,
) -> dict[str, Any]:
    """Fit ``names`` on the protocol's fit period for ``split`` and score them on ``users`` (default: all)."""
    check_protocol(protocol)
    fit_on = fit_period(protocol, split)
    users = list(users) if users is not None else data.eval_users(split)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        baseline = fit_baseline(name, data, fit_on, sasrec_settings=sasrec_settings, cache_dir=cache_dir,
                                progress=progress)
        start = time.perf_counter()
        rankings = baseline.rank(users, max(ks), exclude_history)
        rank_s = time.perf_counter() - start
        out[name] = {
            **evaluate_rankings(rankings, users, ks), "fit_seconds": round(baseline.fit_seconds, 2),
            "fit_on": baseline.fit_on, "rank_seconds": round(rank_s, 2),
            **({"info": {k: v for k, v in baseline.info.items() if k != "history"}} if baseline.info else {}),
        }
    return {"protocol": protocol, "baselines": out}


def format_table(result: dict[str, Any]) -> str:
    """Markdown table: a row for the model (when evaluated) and each baseline; Recall@K / NDCG@K, fit seconds."""
    ks = result["ks"]
    head = ["", "fit on"] + [f"{m}@{k}" for k in ks for m in ("Recall", "NDCG")] + ["fit s"]
    rows: list[list[str]] = []
    if "model" in result:
        rows.append(["model", str(result.get("model_fit_on", "bundle"))]
                    + [f"{result['model'][f'{m}@{k}']:.4f}" for k in ks for m in ("recall", "ndcg")] + ["-"])
    for name, r in result.get("baselines", {}).items():
        info = r.get("info", {})
        cached = " (cached)" if info.get("cached") else " (selection cached)" if info.get("selection_cached") else ""
        rows.append([name, r["fit_on"]] + [f"{r[f'{m}@{k}']:.4f}" for k in ks for m in ("recall", "ndcg")]
                    + [f"{r['fit_seconds']:.1f}{cached}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
