"""The figures a reader of ``recsvc eval`` asks first, read from its paired comparisons (``"headline"`` in the JSON):

- the served lists against the strongest sequential baseline (SASRec when evaluated, else the best plain baseline
  at Recall@k) given the same fresh slots (``NAME+fresh``; the plain baseline when the bundle has no slots):
  Recall@k and NDCG@k, the ratio and its 95% paired interval;
- the model's own lists without the slots (beams, with the fused prior and dense head as served) against the
  same baseline without slots, on the warm slice (targets seen in the fitting period);
- the model's own lists' and the served lists' Recall@k / NDCG@k on the cold slice (targets nobody interacted
  with in the fitting period): what the model reaches of new items by itself, and with the slots;
- what the generative target adds over the prior it is fused with: the served lists against the prior's own
  ranking on the evaluated split (paired, the same slots), and the figure its tuning measured on validation
  (bundle.json "target_over_prior", written by ``recsvc tune prior`` / ``tune mix``: the fused target's full
  decode against the prior alone, NDCG@10 and Recall@10 with 95% paired bootstrap intervals).

k is 10 when evaluated, else the largest cutoff.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from training.evaluation.lead import best_baseline
from training.evaluation.paired import find_pair, lead_cell

PREFERRED = "sasrec"


def headline_k(ks: list[int]) -> int:
    return 10 if 10 in ks else max(ks)


def _pair(result: Mapping[str, Any], model: str, baseline: str, part: str, k: int) -> dict[str, Any] | None:
    rec = find_pair(result.get("paired") or [], model, baseline)
    if rec is None:
        return None
    return {"model": model, "baseline": baseline, "slice": part,
            **{m: rec["slices"][part].get(f"{m}@{k}") for m in ("recall", "ndcg")}}


def headline(result: Mapping[str, Any]) -> dict[str, Any]:
    """The ``"headline"`` block of an evaluation result (after its ``"paired"`` list is filled)."""
    k = headline_k(list(result["ks"]))
    baselines = result.get("baselines") or {}
    base = PREFERRED if PREFERRED in baselines else best_baseline(result, f"recall@{k}")
    own = "model_without_fresh" if result.get("model_without_fresh") else "model"
    served = f"{base}+fresh" if f"{base}+fresh" in baselines else base
    return {
        "k": k, "baseline": base,
        "served_vs_baseline": _pair(result, "model", served, "all", k) if served else None,
        "own_vs_baseline_warm": _pair(result, own, base, "warm", k) if base else None,
        "served_vs_prior_alone": _pair(result, "model", "prior_alone", "all", k),
        "target_over_prior": result.get("target_over_prior"),
        "cold": {"users": result["model"]["cold"]["users"], "own_model": own,
                 **{f"own_{m}": result[own]["cold"][f"{m}@{k}"] for m in ("recall", "ndcg")},
                 **{f"served_{m}": result["model"]["cold"][f"{m}@{k}"] for m in ("recall", "ndcg")}},
    }


def _line(what: str, r: Mapping[str, Any] | None, k: int) -> str | None:
    if r is None:
        return None
    cells = [f"{label}@{k} {r[m]['model']:.4f} vs {r[m]['baseline']:.4f}, {lead_cell(r[m])}"
             for m, label in (("recall", "Recall"), ("ndcg", "NDCG")) if r.get(m)]
    users = int(r["recall"]["users"]) if r.get("recall") else 0
    return f"- {what} ({users} users): " + "; ".join(cells)


def format_headline(h: Mapping[str, Any]) -> str:
    k, base = h["k"], h["baseline"]
    cold = h["cold"]
    slots = h["served_vs_baseline"] and h["served_vs_baseline"]["baseline"].endswith("+fresh")
    lines = [f"headline at {k} (95% paired bootstrap intervals of the ratio):",
             _line(f"served lists vs {base}" + (" with the same fresh slots" if slots else ""),
                   h["served_vs_baseline"], k),
             _line(f"the model without slots vs {base}, warm slice", h["own_vs_baseline_warm"], k),
             f"- cold slice ({int(cold['users'])} users): Recall@{k} {cold['own_recall']:.4f} from the model's own "
             f"lists (no slots), {cold['served_recall']:.4f} served",
             _line("served lists vs the prior alone (what the target adds over the prior it fuses)",
                   h.get("served_vs_prior_alone"), k)]
    if h.get("target_over_prior"):
        lines.append("- " + format_target_over_prior(h["target_over_prior"]))
    return "\n".join(line for line in lines if line)


def format_target_over_prior(r: Mapping[str, Any]) -> str:
    """``the fused target over the prior alone (validation, 4295 users, tune mix): NDCG@10 1.19x [1.06, 1.34] ...``"""
    cells = []
    for m, label in (("ndcg", "NDCG"), ("recall", "Recall")):
        c = r.get(f"{m}@{r.get('k', 10)}")
        if not c:
            continue
        ratio = (f"{c['ratio']:.3f}x [{c['ratio_lo']:.3f}, {c['ratio_hi']:.3f}]"
                 if c.get("ratio") is not None and c.get("ratio_lo") is not None else f"{c['diff']:+.4f}")
        cells.append(f"{label}@{r.get('k', 10)} {c['fused']:.4f} vs {c['prior_alone']:.4f}, {ratio}")
    return (f"the fused target over the prior alone ({r['split']}, {r['users']} users, {r['source']}, "
            f"95% paired bootstrap): " + "; ".join(cells))
