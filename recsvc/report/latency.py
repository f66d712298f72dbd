"""Latency against K per decoding mode: `recsvc bench decode` (the engine's beam search beside transformers
``generate``, the baseline) and `recsvc bench speculative` (speculative settings beside plain beam search, the
baseline, with the wall-clock speedup WS).

Layouts (``bench/decode.py``, ``bench/speculative.py``): ``"rows"`` of ``{"k", "engine_ms",
"generate_ms", "speedup", "identical_rate", "users"}``, resp. ``{"k", "setting": "fixed"|"auto", "N", "gamma",
"plain_ms", "spec_ms", "WS", "AS", ...}``; ``"machine"``, ``"dtype"``, ``"device"``, ``"mode"``, ``"drafter"``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from recsvc.report.figure import BASELINE_STYLE, MODEL_COLOR, PALETTE, Context, pyplot, save, title

LATENCY = "latency (ms per request, mean)"


def _precision(data: dict[str, Any]) -> str | None:
    dtype = data.get("dtype")
    return f"{dtype} on {data['device']}" if dtype and data.get("device") else dtype


def _k_axis(ax: Any, ks: list[int]) -> None:
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel("K (items per request; beams searched)")
    if len(ks) == 1:
        ax.set_xlim(ks[0] - 1, ks[0] + 1)
    else:  # room for the last point's note
        ax.margins(x=0.15, y=0.12)


def plot_decode(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
                formats: list[str]) -> list[Path]:
    plt = pyplot()
    rows = sorted(data["rows"], key=lambda r: r["k"])
    ks = [int(r["k"]) for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    ax.plot(ks, [r["generate_ms"] for r in rows], label="transformers generate + trie callback (baseline)",
            **BASELINE_STYLE)
    ax.plot(ks, [r["engine_ms"] for r in rows], marker="o", color=MODEL_COLOR, label="engine beam search")
    ax.set_ylabel(LATENCY)
    ax.set_ylim(bottom=0)
    ax.set_title("latency against K", fontsize=8)
    ax.legend(fontsize=7)
    _k_axis(ax, ks)
    ax2.plot(ks, [r["speedup"] for r in rows], marker="o", color=MODEL_COLOR, label="generate ms / engine ms")
    for k, r in zip(ks, rows, strict=True):
        same = f", identical {r['identical_rate']:.0%}" if r.get("identical_rate") is not None else ""
        ax2.annotate(f"{r['speedup']:.2f}x{same}", (k, r["speedup"]),
                     textcoords="offset points", xytext=(4, 4), fontsize=6)
    ax2.axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="parity (1.0x)")
    ax2.set_ylabel("speedup over generate (x)")
    ax2.set_ylim(0, 1.2 * max([1.0, *(r["speedup"] for r in rows)]))
    ax2.set_title("the engine's speedup (identical: same items in the same order)", fontsize=8)
    ax2.legend(fontsize=7)
    _k_axis(ax2, ks)
    users = rows[0].get("users", "?") if rows else "?"
    title(fig, "decoding latency: the engine beside transformers generate", ctx, data.get("machine"),
          _precision(data), f"one request at a time, {users} {data.get('split', '')} users, attention "
                            f"{data.get('attention', '?')}")
    return save(fig, out_dir, f"{name}_latency", formats)


def _n_label(n: int, k: int) -> str:
    """N relative to K where it is (the grid's K, 2K, K/2), else the number."""
    return {k: "K", 2 * k: "2K"}.get(n, "K/2" if k > 1 and n == k // 2 else str(n))


def plot_speculative(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
                     formats: list[str]) -> list[Path]:
    plt = pyplot()
    by_k: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in data["rows"]:
        by_k[int(r["k"])].append(r)
    ks = sorted(by_k)
    series: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for k in ks:
        for r in by_k[k]:
            label = ("auto (chosen on validation users)" if r.get("setting") == "auto"
                     else f"N = {_n_label(int(r['N']), k)}, gamma = {r['gamma']}")
            series[label].append((k, r))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    plain = [sum(r["plain_ms"] for r in by_k[k]) / len(by_k[k]) for k in ks]
    mode = data.get("mode", "strict")
    ax.plot(ks, plain, label=f"plain {'sampling ' if mode == 'relaxed' else ''}beam search (baseline)",
            **BASELINE_STYLE)
    for i, (label, pts) in enumerate(series.items()):
        colour = MODEL_COLOR if label.startswith("auto") else PALETTE[i % len(PALETTE)]
        xs = [k for k, _ in pts]
        ax.plot(xs, [r["spec_ms"] for _, r in pts], marker="o", color=colour, label=f"speculative, {label}")
        ax2.plot(xs, [r["WS"] for _, r in pts], marker="o", color=colour, label=label)
        if label.startswith("auto"):
            for k, r in pts:
                chosen = "plain" if int(r["N"]) == 0 else f"N={r['N']}, gamma={r['gamma']}"
                accepted = f", AS {r['AS']:.2f}" if r.get("AS") is not None else ""
                ax2.annotate(f"{r['WS']:.2f}x ({chosen}){accepted}", (k, r["WS"]),
                             textcoords="offset points", xytext=(4, 4), fontsize=6)
    ax.set_ylabel(LATENCY)
    ax.set_ylim(bottom=0)
    ax.set_title("latency against K per decoding mode", fontsize=8)
    ax.legend(fontsize=7)
    _k_axis(ax, ks)
    ax2.axhline(1.0, color="black", linewidth=0.8, linestyle=":", label="parity with plain (1.0x)")
    ax2.set_ylabel("WS@K: plain ms / speculative ms (x)")
    ax2.set_ylim(0, 1.2 * max([1.0, *(r["WS"] for r in data["rows"])]))
    ax2.set_title("wall-clock speedup WS@K (AS: accepted draft depths per request)", fontsize=8)
    ax2.legend(fontsize=7)
    _k_axis(ax2, ks)
    users = data["rows"][0].get("users", "?") if data["rows"] else "?"
    title(fig, f"{mode} speculative beam search, {data.get('drafter', '?')} drafter, beside plain beam search",
          ctx, data.get("machine"), _precision(data),
          f"one request at a time, {users} {data.get('split', '')} users, plain and speculative interleaved"
          + (", the bundle's prior fused" if data.get("prior") else ""))
    return save(fig, out_dir, f"{name}_latency", formats)
