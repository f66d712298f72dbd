"""Serving figures: `recsvc bench cache` (a returning user's cached state beside uncached requests),
`recsvc bench replay` (throughput and tail latency against concurrency per state-cache configuration) and
`recsvc bench serve` (the gRPC service under load per batching / decoding configuration).

Layouts: cache (``bench/cache.py``): ``"rows"`` of ``{"path": lean|fast|compiled|cached|repeat, "p50_ms",
"mean_ms", "forwards_per_request", ...}``, ``"floor_uncached_ms"`` / ``"floor_cached_ms"`` where measured; replay
(``bench/replay.py``): ``"rows"`` of ``{"cache", "concurrency", "requests_per_s", "p50_ms", "p99_ms",
"hit_rate", ...}``; serve (``bench/serve.py``): ``"rows"`` of ``{"config": "batch16/strict", "max_batch",
"mode", "concurrency", "throughput_rps", "p50_ms", "p99_ms", ...}``, ``"serving"`` (``"precision"``, ...).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from recsvc.report.figure import (
    BASELINE_COLOR,
    BASELINE_STYLE,
    MODEL_COLOR,
    PALETTE,
    Context,
    log2_if_wide,
    pyplot,
    save,
    title,
)

PATHS = {  # cache bench path -> (legend text, cached?)
    "lean": ("lean: every beam fed (uncached, baseline)", False),
    "fast": ("fast forward (uncached)", False),
    "compiled": ("compiled forward (uncached)", False),
    "cached": ("returning user: prompt state cached", True),
    "repeat": ("identical request: every step cached", True),
}


def plot_cache(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
               formats: list[str]) -> list[Path]:
    plt = pyplot()
    rows = data["rows"]
    base = next((r for r in rows if r["path"] == "lean"), rows[0])
    fig, ax = plt.subplots(figsize=(10, 5))
    labels, colours = [], []
    for i, r in enumerate(rows):
        text, cached = PATHS.get(r["path"], (r["path"], False))
        labels.append(text)
        colours.append(BASELINE_COLOR if r is base else MODEL_COLOR if cached else PALETTE[i % len(PALETTE)])
    bars = ax.bar(range(len(rows)), [r["p50_ms"] for r in rows], color=colours,
                  hatch=None, edgecolor="black", linewidth=0.3)
    for b, r in zip(bars, rows, strict=True):
        forwards = (f"\n{r['forwards_per_request']:.1f} forwards/req"
                    if r.get("forwards_per_request") is not None else "")
        ax.annotate(f"{r['p50_ms']:.1f} ms\n{r['p50_ms'] / base['p50_ms']:.2f}x lean{forwards}",
                    (b.get_x() + b.get_width() / 2, b.get_height()), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=7)
    for key, text, style in (("floor_uncached_ms", "linear floor, uncached request", "--"),
                             ("floor_cached_ms", "linear floor, prompt-cached request", ":")):
        if isinstance(data.get(key), (int, float)):
            ax.axhline(data[key], color="black", linestyle=style, linewidth=0.8, label=f"{text}: {data[key]:.1f} ms")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=12, ha="right", fontsize=7)
    ax.set_xlabel("decoding path (cached: the request reuses a returning user's stored state)")
    ax.set_ylabel("latency (ms per request, median)")
    ax.margins(y=0.25)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right")
    title(fig, "cached vs uncached requests: the user-state cache beside the uncached paths", ctx,
          data.get("machine"), data.get("dtype"),
          f"K = {data.get('k', '?')}, beam width {data.get('beam_width', '?')}, {data.get('users', '?')} "
          f"{data.get('split', '')} users, one request at a time; the state's forward: "
          f"{data.get('state_forward', '?')}")
    return save(fig, out_dir, f"{name}_latency", formats)


def _by_config(rows: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[str(r[key])].append(r)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in out.items()}


def _load_panels(plt: Any, groups: dict[str, list[dict[str, Any]]], baseline: str | None, legend: dict[str, str],
                 rps_key: str):
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    levels = sorted({r["concurrency"] for rows in groups.values() for r in rows})
    for i, (config, rows) in enumerate(groups.items()):
        style = BASELINE_STYLE if config == baseline else {"color": PALETTE[i % len(PALETTE)], "marker": "o"}
        if config != baseline and i == 0:
            style = {"color": MODEL_COLOR, "marker": "o"}
        text = legend.get(config, config) + (" (baseline)" if config == baseline else "")
        xs = [r["concurrency"] for r in rows]
        ax.plot(xs, [r[rps_key] or 0.0 for r in rows], label=text, **style)
        ax2.plot(xs, [r["p99_ms"] if r["p99_ms"] is not None else float("nan") for r in rows], label=text, **style)
    for a in (ax, ax2):
        log2_if_wide(a, levels)
        a.set_xlabel("concurrent callers")
        a.set_ylim(bottom=0)
        a.legend(fontsize=7)
    ax.set_title("throughput against concurrency", fontsize=8)
    ax2.set_title("tail latency against concurrency", fontsize=8)
    ax2.set_ylabel("p99 latency (ms per call)")
    return fig, ax


REPLAY = {"off": "state cache off", "lean": "state cache off, lean forward", "on": "state cache on",
          "ahead": "state cache on + prefill ahead", "compiled": "state cache on, compiled forward"}


def plot_replay(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
                formats: list[str]) -> list[Path]:
    plt = pyplot()
    groups = _by_config(data["rows"], "cache")
    baseline = next((c for c in ("off", "lean") if c in groups), None)
    fig, ax = _load_panels(plt, groups, baseline, REPLAY, "requests_per_s")
    ax.set_ylabel("throughput (calls/s: Recommend + Record)")
    title(fig, "a test period replayed against recsvc serve + redis-server, per state-cache configuration", ctx,
          data.get("machine"), data.get("dtype"),
          f"{data.get('users', '?')} users, {data.get('events', '?')} interactions, R = {data.get('r', '?')} "
          f"Recommend calls before each RecordInteractions, K = {data.get('k', '?')}")
    return save(fig, out_dir, f"{name}_throughput", formats)


def plot_serve(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
               formats: list[str]) -> list[Path]:
    plt = pyplot()
    rows = [{**r, "config": r.get("config") or f"batch{r['max_batch']}/{r['mode']}"} for r in data["rows"]]
    groups = _by_config(rows, "config")
    baseline = next((c for c in ("batch1/plain", "server/plain") if c in groups), None)
    legend = {c: c.replace("batch", "max batch ").replace("/", ", mode ") for c in groups}
    fig, ax = _load_panels(plt, groups, baseline, legend, "throughput_rps")
    ax.set_ylabel("throughput (successful Recommend calls/s)")
    serving = data.get("serving") or {}
    title(fig, "the gRPC service under load, per batching and decoding mode", ctx, data.get("machine"),
          serving.get("precision") or serving.get("dtype"),
          f"K = {data.get('k', '?')}, {data.get('users', '?')} users, {data.get('duration_s', '?')} s per level, "
          f"beam width {serving.get('beam_width', '?')}")
    return save(fig, out_dir, f"{name}_throughput", formats)
