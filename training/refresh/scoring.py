"""The gate's figures: today's and yesterday's bundles ranking today's kept-aside items, each as it is served
(``training.evaluation.bundle_ranking.rank_bundle``, protocol "paper": the models trained without those items,
the transition prior counted on today's train period for both), NDCG@10 per user, paired."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def gate_figures(today: Path, yesterday: Path, data_dir: Path, reference: float | None) -> GateFigures:
    """Both bundles on ``data_dir``'s validation users (today's kept-aside items), with today's history rule."""
    from recsvc.bundle.directory import Bundle
    from training.evaluation.bundle_ranking import rank_bundle
    from training.evaluation.lead import paired_lead
    from training.evaluation.paired import slice_scores

    excl = Bundle.open(today).serves_excluding_history()
    a = rank_bundle(today, "valid", [10], data_dir=data_dir, exclude_history=excl, protocol="paper")
    b = rank_bundle(yesterday, "valid", [10], data_dir=data_dir, exclude_history=excl, protocol="paper")
    assert a is not None and b is not None  # one process: rank 0
    users = {"all": [u for u in a.users if u.targets]}
    mine = slice_scores(a.lists, users, [10])["all"]["ndcg@10"]  # [n]
    theirs = slice_scores(b.lists, users, [10])["all"]["ndcg@10"]  # [n]
    lead = paired_lead(mine, theirs)
    return GateFigures(len(users["all"]), float(mine.mean()) if len(mine) else 0.0,
                       float(theirs.mean()) if len(theirs) else 0.0, lead["ratio"], lead["ratio_lo"],
                       lead["ratio_hi"], reference)
