"""Plots of a `recsvc eval --json` file: quality per method and cutoff, the model's paired lead over each
baseline with its 95% bootstrap interval, and the cold / warm target slices.

The JSON's layout (``training/evaluation/evaluate.py``): ``"ks"``; ``"model"``: ``{"recall@K", "ndcg@K", "cold": {...,
"users"}, "warm": {...}}``; ``"baselines"``: ``{name: the same keys}`` (``name+fresh``: the baseline with the
model's fresh slots, not plotted); ``"lead"``: ``{name: {"recall@K": {"ratio", "ratio_lo", "ratio_hi", ...}}}``;
``"split"``, ``"users"``, ``"protocol"``, ``"exclude_history"``, ``"dtype"``; with ``--against``, ``"against"``
(drawn by ``recsvc.report.against``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recsvc.report.figure import (
    BASELINE_COLOR,
    MODEL_COLOR,
    PALETTE,
    Context,
    cutoff_axis,
    pyplot,
    ratio_points,
    save,
    title,
)

METRICS = (("recall", "Recall@K (share of the held-out items in the top K)"),
           ("ndcg", "NDCG@K (0 to 1)"))
MODEL = "model"  # the title says what its lists held (prior, fresh slots)


def methods(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(label, metrics, colour): the model, then each baseline, followed by its ``+fresh`` variant (the same fresh
    slots as the model's lists) where the evaluation scored one."""
    base = data.get("baselines") or {}
    out = [(MODEL, data["model"], MODEL_COLOR)]
    colours = (BASELINE_COLOR, *PALETTE)
    for i, name in enumerate(n for n in base if "+" not in n):
        out.append((name, base[name], colours[i % len(colours)]))
        if isinstance(base.get(f"{name}+fresh"), dict):
            out.append((f"{name}+fresh", base[f"{name}+fresh"], colours[i % len(colours)]))
    return out


def _details(data: dict[str, Any]) -> str:
    hist = "history items excluded" if data.get("exclude_history") else "history items kept"
    users = data.get("users")
    served = []  # what the model's lists hold besides the target's beams (recorded by recsvc eval)
    if "prior" in data:
        prior = data["prior"]
        weight = prior.get("weight") if isinstance(prior, dict) else None
        shown = f"{weight:.2f}" if isinstance(weight, (int, float)) else "?"
        served.append(f"prior weight {shown} fused" if isinstance(prior, dict) else "no prior")
    if "fresh" in data:
        fresh = data["fresh"]
        served.append(f"{fresh.get('slots', '?')} fresh slots" if isinstance(fresh, dict) else "no fresh slots")
    return (f"{data.get('split', '?')} split, {int(users) if isinstance(users, (int, float)) else '?'} users, protocol "
            f"{data.get('protocol', data.get('bundle_protocol', '?'))}, {hist}"
            + (f"; the model: {data.get('target', 'target')}, {', '.join(served)}" if served else "")
            + "; every method on the same users")


def _bars(ax: Any, ks: list[int], rows: list[tuple[str, dict[str, Any], str]], metric: str, ylabel: str) -> None:
    width = 0.8 / len(rows)
    top = 0.0
    for i, (label, values, colour) in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(ks))]
        ys = [float(values[f"{metric}@{k}"]) for k in ks]
        top = max(top, *ys)
        hatch = None if label == MODEL else "xx" if label.endswith("+fresh") else "//"
        bars = ax.bar(xs, ys, width, label=label, color=colour, hatch=hatch,
                      edgecolor="white" if label == MODEL else "black", linewidth=0.3,
                      alpha=0.6 if hatch == "xx" else 1.0)
        ax.bar_label(bars, fmt="%.3f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([f"K = {k}" for k in ks])
    ax.set_xlabel("cutoff K (items recommended)")
    ax.set_ylabel(ylabel)
    if top > 0:
        ax.set_ylim(0, top * 1.4)  # room for the legend above the bars
    else:  # nothing hit: say so rather than draw an empty axis around 0
        ax.set_ylim(0, 0.01)
        ax.text(0.5, 0.6, "every method scores 0 here", ha="center", transform=ax.transAxes)


def _leads(ax: Any, ks: list[int], data: dict[str, Any], metric: str, label: str) -> None:
    lead = data.get("lead") or {}
    names = [name for name in lead if name in (data.get("baselines") or {})]  # not the prior read alone
    colours = (BASELINE_COLOR, *PALETTE)
    plain = [n for n in names if "+" not in n]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        pts = [(j + (i - (len(names) - 1) / 2) * width, lead[name].get(f"{metric}@{k}") or {})
               for j, k in enumerate(ks)]
        ratio_points(ax, pts, "D" if name.endswith("+fresh") else "o",
                     colours[plain.index(name.split("+")[0]) % len(colours)], f"model / {name}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="parity (1.0x)")
    ratios = [float(r["ratio"]) for n in names for r in lead[n].values() if isinstance(r, dict) and r.get("ratio")]
    if ratios and max(ratios) / min(ratios) >= 8:  # leads and deficits both readable
        ax.set_yscale("log")
    cutoff_axis(ax, ks)
    ax.set_ylabel(f"{label}: model / baseline (ratio of means)")
    ax.set_title(f"{label}: the model's lead, 95% paired bootstrap interval", fontsize=8)
    ax.legend(fontsize=7, loc="best")


def plot_quality(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
                 formats: list[str]) -> list[Path]:
    plt = pyplot()
    ks = [int(k) for k in data["ks"]]
    rows = methods(data)
    has_lead = any(n in (data.get("baselines") or {}) for n in (data.get("lead") or {}))
    fig, axes = plt.subplots(2 if has_lead else 1, 2, figsize=(11, 8.5 if has_lead else 4.8), squeeze=False)
    for col, (metric, ylabel) in enumerate(METRICS):
        ax = axes[0][col]
        _bars(ax, ks, rows, metric, ylabel)
        ax.set_title(f"{metric.replace('recall', 'Recall').replace('ndcg', 'NDCG')}@K per method", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
        if has_lead:
            _leads(axes[1][col], ks, data, metric, "Recall@K" if metric == "recall" else "NDCG@K")
    title(fig, "recommendation quality, the model beside its baselines", ctx, data.get("machine"), data.get("dtype"),
          _details(data))
    return save(fig, out_dir, f"{name}_quality", formats)


def plot_cold_warm(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
                   formats: list[str]) -> list[Path]:
    """Rows cold / warm, columns Recall / NDCG; [] when the file has no slices (an older evaluation)."""
    rows = [r for r in methods(data) if isinstance(r[1].get("cold"), dict) and isinstance(r[1].get("warm"), dict)]
    if not rows or rows[0][0] != MODEL:
        return []
    plt = pyplot()
    ks = [int(k) for k in data["ks"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    fit_on = data.get("fit_on", "the fitting period")
    for r, part in enumerate(("cold", "warm")):
        users = data["model"][part].get("users")
        what = (f"cold targets (items never interacted with in {fit_on})" if part == "cold"
                else f"warm targets (items seen in {fit_on})")
        for col, (metric, ylabel) in enumerate(METRICS):
            ax = axes[r][col]
            ax.set_title(f"{what}: {int(users) if users is not None else '?'} users", fontsize=8)
            if users == 0:  # no user has such a target: nothing measured
                ax.text(0.5, 0.5, f"no {part} targets in this split", ha="center", va="center",
                        transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            _bars(ax, ks, [(label, values[part], colour) for label, values, colour in rows], metric, ylabel)
            ax.legend(fontsize=7, loc="upper left")
    extra = f"; {data['cold_items']} cold items" if data.get("cold_items") is not None else ""
    title(fig, "quality on cold and warm targets, the model beside its baselines", ctx, data.get("machine"),
          data.get("dtype"),
          _details(data) + extra)
    return save(fig, out_dir, f"{name}_cold_warm", formats)


def plot_eval(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
              formats: list[str]) -> list[Path]:
    from recsvc.report.against import plot_against

    return [*plot_quality(path, data, ctx, out_dir, name, formats),
            *plot_cold_warm(path, data, ctx, out_dir, name, formats),
            *plot_against(path, data, ctx, out_dir, name, formats)]
