"""What every report figure shares: the Agg backend, the title (what, then the machine and precision), the
baseline's style, and the PNG + SVG writing (reproducible files: no dates, text kept as text in the SVG)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_COLOR = "#1f77b4"
BASELINE_COLOR = "#7f7f7f"
BASELINE_STYLE = {"color": BASELINE_COLOR, "linestyle": "--", "marker": "s"}
# one colour per further series (methods, decoding modes, cache configurations)
PALETTE = ("#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")


@dataclass(frozen=True)
class Context:
    """What a figure's title says beyond its own JSON: the data set's label, and the machine and precision to
    show where the JSON does not record them."""

    label: str = ""
    machine: str | None = None
    precision: str | None = None


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display), SVG text kept as text, no timestamps in the files."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "recsvc-report", "font.size": 9,
                         "axes.titlesize": 10, "figure.titlesize": 11, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def title(fig: Any, what: str, ctx: Context, machine: str | None, precision: str | None,
          details: str = "") -> None:
    """The figure's title: ``label: what``, then the details, then ``precision: ... | machine: ...`` (the JSON's
    own record first, else the context's, else "not recorded")."""
    head = f"{ctx.label}: {what}" if ctx.label else what
    where = machine or ctx.machine or "not recorded (pass --machine)"
    prec = precision or ctx.precision or "not recorded (pass --precision)"
    lines = [*textwrap.wrap(head, 120), *textwrap.wrap(details, 130),
             *textwrap.wrap(f"precision: {prec} | machine: {where}", 130)]
    fig.suptitle("\n".join(lines), fontsize=9, y=0.995, va="top")


def save(fig: Any, out_dir: Path, name: str, formats: Sequence[str]) -> list[Path]:
    """Write ``out_dir/name.{png,svg}`` -> paths (the layout leaves the title its room)."""
    plt = pyplot()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        path = out_dir / f"{name}.{fmt}"
        meta = {"Date": None} if fmt == "svg" else {"Software": None}
        fig.savefig(path, format=fmt, dpi=100, metadata=meta)
        written.append(path)
    plt.close(fig)
    return written


def log2_if_wide(ax: Any, values: Sequence[float]) -> None:
    """A base-2 log x axis when the values span 8x or more (concurrency 1..16), ticks at the values."""
    vals = sorted(set(values))
    if vals and vals[0] > 0 and vals[-1] / vals[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(vals)
    ax.set_xticklabels([f"{v:g}" for v in vals])


def ratio_points(ax: Any, points: Sequence[tuple[float, Mapping[str, Any]]], fmt: str, colour: str,
                 label: str) -> None:
    """Paired leads (``{"ratio", "ratio_lo", "ratio_hi"}``) at their x: each ratio with its 95% interval as an
    error bar, annotated ``1.10x``; a point without a ratio is left out, a missing bound draws no bar."""
    pts = [(x, r) for x, r in points if r.get("ratio") is not None]
    if not pts:
        return
    ys = [float(r["ratio"]) for _, r in pts]
    lo = [y - float(r["ratio_lo"]) if r.get("ratio_lo") is not None else 0.0 for y, (_, r) in zip(ys, pts, strict=True)]
    hi = [float(r["ratio_hi"]) - y if r.get("ratio_hi") is not None else 0.0 for y, (_, r) in zip(ys, pts, strict=True)]
    ax.errorbar([x for x, _ in pts], ys, yerr=[lo, hi], fmt=fmt, capsize=3, color=colour, label=label)
    for (x, _), y in zip(pts, ys, strict=True):
        ax.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(4, 0), fontsize=6, va="center")


def cutoff_axis(ax: Any, ks: Sequence[int]) -> None:
    """The x axis of a per-cutoff plot: one slot per K."""
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([f"K = {k}" for k in ks])
    ax.set_xlim(-0.5, len(ks) - 0.5)
    ax.set_xlabel("cutoff K (items recommended)")
