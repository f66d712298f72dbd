"""``recsvc build --plan``: what one epoch of target training costs on this machine, before training.

A data scientist bringing a new catalog needs to know, before a multi-hour run, whether its epochs fit the
budget. The plan counts the work of an epoch (tokens, and the share of them that carry a label, for the selection
phase on the train period and the deploy refit on train + valid), times a few real optimizer steps of the chosen
preset on real batches (same batch size, threads and precision as the run), and projects minutes per epoch and
the epochs that fit ``--max-minutes``. Validation passes (a beam search over the validation users after each
epoch) come on top; their cost is printed by the training run itself.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from training.target_lm.budget import PROBE_WARMUP, contention_warning, time_steps
from training.target_lm.sequences import Example, bucketed_batches, collate, count_tokens
from training.target_lm.train import TrainConfig, lm_loss, resolve_bf16


def probe_tokens_per_s(model, examples: list[Example], cfg: TrainConfig, pad_id: int, steps: int) -> float:
    """Training tokens per second of ``steps`` timed AdamW steps on shuffled, length-bucketed batches.

    The model is trained in place (use a throw-away copy). Padding is work but not a token, as in the loop."""
    bf16 = resolve_bf16(cfg.bf16, torch.device("cpu"))
    batches = bucketed_batches([len(e) for e in examples], cfg.batch_size, seed=cfg.seed)[:PROBE_WARMUP + steps]
    seconds, tokens = time_steps(model, lambda idx: collate([examples[j] for j in idx], pad_id), lm_loss, batches,
                                 cfg.lr, cfg.weight_decay, bf16)
    if tokens == 0 or seconds <= 0:
        return float("nan")
    return tokens / seconds


def epoch_plan(selection: list[Example], refit: list[Example] | None, tokens_per_s: float,
               max_minutes: float | None, epochs: int) -> dict[str, Any]:
    """Projected minutes per epoch and the epochs that fit the budget (pure arithmetic, tested).

    >>> ex = [Example([1, 2, 3, 4], [-100, -100, 3, 4])] * 1000
    >>> p = epoch_plan(ex, None, tokens_per_s=100.0, max_minutes=2.0, epochs=5)
    >>> p["selection"]["minutes_per_epoch"], p["selection"]["labelled_share"], p["epochs_in_budget"]
    (0.67, 0.5, 3.0)
    """
    ok = tokens_per_s > 0 and math.isfinite(tokens_per_s)

    def phase(examples: list[Example]) -> dict[str, Any]:
        tokens, labelled = count_tokens(examples)
        return {"windows": len(examples), "tokens_per_epoch": tokens, "labelled_tokens_per_epoch": labelled,
                "labelled_share": round(labelled / max(tokens, 1), 3),
                "minutes_per_epoch": round(tokens / tokens_per_s / 60, 2) if ok else None}

    out: dict[str, Any] = {"train_tokens_per_s": round(tokens_per_s, 1), "selection": phase(selection)}
    per_epoch = count_tokens(selection)[0] / tokens_per_s / 60 if ok else None
    out["selection"]["minutes_for_epochs"] = round(per_epoch * epochs, 1) if per_epoch else None
    out["epochs_in_budget"] = (math.floor(10 * max_minutes / per_epoch) / 10
                               if max_minutes and per_epoch else None)
    if refit is not None:
        out["refit"] = phase(refit)
    return out


def render_plan(plan: dict[str, Any], epochs: int, max_minutes: float | None) -> str:
    lines = [f"training throughput (probe): {plan['train_tokens_per_s']:.0f} tokens/s"]
    for name in ("selection", "refit"):
        if name not in plan:
            continue
        p = plan[name]
        lines.append(f"{name}: {p['windows']} windows, {p['tokens_per_epoch']} tokens per epoch "
                     f"({p['labelled_share']:.0%} labelled), {p['minutes_per_epoch']} min per epoch")
    sel = plan["selection"]
    lines.append(f"{epochs} selection epoch(s): {sel['minutes_for_epochs']} min of training (+ validation passes)")
    if max_minutes:
        lines.append(f"--max-minutes {max_minutes:g}: about {plan['epochs_in_budget']} epochs fit")
    fit = plan.get("fit_budget")
    if fit:
        lines.append(f"--fit-budget: a {fit['epochs']}-epoch schedule (epoch {fit['epoch_seconds'] / 60:.1f} min + "
                     f"validation pass {fit['eval_seconds'] / 60:.1f} min; {fit['epochs_fit']} epochs fit, "
                     f"at most --epochs {fit['max_epochs']})")
        if (warning := contention_warning(fit)) is not None:
            lines.append(f"warning: {warning}")
    return "\n".join(lines)
