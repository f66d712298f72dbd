"""Plot of a `recsvc eval --against --json` file: the ratio A / B (this bundle's lists against the second bundle's,
or against itself without a part) per cutoff, with its 95% paired bootstrap interval, on every user and on the
cold and warm slices.

The JSON's ``"against"`` (``training/evaluation/compare.py``): ``"label"``, ``"bundle"``, ``"variant"``, ``"metrics"``
(B's Recall@K / NDCG@K) and ``"lead"``: ``{"all" | "cold" | "warm": {"recall@K": {"ratio", "ratio_lo", "ratio_hi",
"users", "diff", "diff_se"}}}``. A slice where B scores 0 has no ratio: it is named in the panel instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recsvc.report import figure
from recsvc.report.figure import Context

SLICE_STYLE = {"all": (figure.MODEL_COLOR, "o"), "cold": (figure.PALETTE[0], "D"), "warm": (figure.PALETTE[1], "s")}


def _panel(ax: Any, ks: list[int], lead: dict[str, Any], metric: str, label: str) -> None:
    missing = []
    for i, (part, (colour, marker)) in enumerate(SLICE_STYLE.items()):
        cells = [(j + (i - 1) * 0.2, (lead.get(part) or {}).get(f"{metric}@{k}") or {}) for j, k in enumerate(ks)]
        missing += [f"{part} @{k}" for (_, r), k in zip(cells, ks, strict=True) if r.get("ratio") is None]
        if any(r.get("ratio") is not None for _, r in cells):
            users = int(next(iter(lead[part].values()))["users"])
            figure.ratio_points(ax, cells, marker, colour, f"{part} ({users} users)")
    ax.axhline(1.0, color=figure.BASELINE_COLOR, linewidth=0.8, linestyle=":", label="parity (1.0x)")
    if missing:  # B scores 0 there (or nobody is in the slice): no ratio to draw
        ax.text(0.02, 0.02, "no ratio (B scores 0 or no users): " + ", ".join(missing), fontsize=6,
                transform=ax.transAxes)
    figure.cutoff_axis(ax, ks)
    ax.set_ylabel(f"{label}: A / B (ratio of means)")
    ax.set_title(f"{label}: A / B with the 95% paired bootstrap interval", fontsize=8)
    ax.legend(fontsize=7, loc="best")


def plot_against(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
                 formats: list[str]) -> list[Path]:
    """The A / B figure; [] when the evaluation compared no second bundle."""
    block = data.get("against")
    if not isinstance(block, dict) or not isinstance(block.get("lead"), dict):
        return []
    plt = figure.pyplot()
    ks = [int(k) for k in data["ks"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), squeeze=False)
    for col, (metric, label) in enumerate((("recall", "Recall@K"), ("ndcg", "NDCG@K"))):
        _panel(axes[0][col], ks, block["lead"], metric, label)
    variant = f", {block['variant']}" if block.get("variant") else ""
    b = f"{block.get('label', '?')} ({block.get('bundle', '?')}{variant})"
    hist = "history items excluded" if data.get("exclude_history") else "history items kept"
    figure.title(fig, "one bundle against another, user by user", ctx, data.get("machine"), data.get("dtype"),
          f"A: the evaluated bundle's lists; B: {b}; {data.get('split', '?')} split, protocol "
          f"{data.get('protocol', data.get('bundle_protocol', '?'))}, {hist}, the same users for both")
    return figure.save(fig, out_dir, f"{name}_against", formats)
