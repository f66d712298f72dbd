"""The gate's figures: today's and yesterday's bundles ranking today's kept-aside items, each as it is served
(``training.evaluation.bundle_ranking.rank_bundle``, protocol "paper": the models trained without those items,
the transition prior counted on today's train period for both), NDCG@10 per user, paired."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from training.refresh.gate import GateFigures


def reference_ndcg(meta: dict[str, Any]) -> float | None:
    """A bundle's NDCG@10 on its own validation as served: a refreshed bundle's gate figure, else the recipe's
    served figure (the prior alone where the mix ranks by the prior, else the fused target), else the target's
    own; None when bundle.json records none."""
    gate = meta.get("refresh", {}).get("gate", {})
    if gate.get("today") is not None:
        return float(gate["today"])
    headline = meta.get("target_over_prior_excl", {}).get("ndcg@10")
    if isinstance(headline, dict):
        by_prior = meta.get("prior_excl", {}).get("rank_by") == "prior"
        value = headline.get("prior_alone" if by_prior else "fused")
        if value is not None:
            return float(value)
    valid = meta.get("stages", {}).get("target", {}).get("selection", {}).get("valid", {})
    return float(valid["ndcg@10"]) if "ndcg@10" in valid else None


def day_scores(bundle: Path, data_dir: Path, exclude_history: bool) -> tuple[list[int], np.ndarray]:
    """(users, NDCG@10 [n]) of ``bundle`` ranking ``data_dir``'s validation users (today's kept-aside items)."""
    from training.evaluation.bundle_ranking import rank_bundle
    from training.evaluation.paired import slice_scores

    ranked = rank_bundle(bundle, "valid", [10], data_dir=data_dir, exclude_history=exclude_history, protocol="paper")
    assert ranked is not None  # one process: rank 0
    users = [u for u in ranked.users if u.targets]
    return [u.user_id for u in users], slice_scores(ranked.lists, {"all": users}, [10])["all"]["ndcg@10"]


def gate_figures(users: list[int], today: np.ndarray, yesterday: np.ndarray, reference: float | None) -> GateFigures:
    """The paired figures of both bundles' ``day_scores`` (the same users, in order)."""
    from training.evaluation.lead import paired_lead

    lead = paired_lead(today, yesterday)
    return GateFigures(len(users), float(today.mean()) if len(today) else 0.0,
                       float(yesterday.mean()) if len(yesterday) else 0.0, lead["ratio"], lead["ratio_lo"],
                       lead["ratio_hi"], reference)
