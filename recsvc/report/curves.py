"""Training curves from a training record (``BUNDLE/target/training.json``, a drafter's ``training.json``;
``training/target_lm/train.py`` writes it): ``"history"``: one row per evaluation, ``{"epoch": 1.0, "train_loss",
"valid_loss", "recall@10", "ndcg@10"}`` (a fractional epoch: a run stopped inside one); ``"best_epoch"``,
``"best": {"metric", "value"}``, ``"preset"``, ``"params"``, ``"stopped"``, ``"refit"``, ``"config": {"bf16",
"lr", ...}``. Losses on the left (nats per labelled token), the selection metrics on the right, the selected
epoch marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recsvc.report.figure import BASELINE_STYLE, MODEL_COLOR, PALETTE, Context, pyplot, save, title

LOSS_LABELS = {"train_loss": "train loss (running mean of the last batches)", "valid_loss": "validation loss",
               "val_loss": "validation loss", "val_align": "validation alignment loss"}
METRIC_LABELS = {"val_topk_containment": "top-K containment: the target's beams among the head's (validation)"}


def _numeric(history: list[dict[str, Any]], key: str) -> bool:
    return all(isinstance(r.get(key), (int, float)) for r in history)


def plot_curves(path: Path, data: dict[str, Any], ctx: Context, out_dir: Path, name: str,
                formats: list[str]) -> list[Path]:
    plt = pyplot()
    history = sorted(data["history"], key=lambda r: float(r["epoch"]))
    keys = [k for k in dict.fromkeys(k for r in history for k in r) if k != "epoch" and _numeric(history, k)]
    losses = [k for k in keys if "loss" in k or k == "val_align"]
    # the 0..1 metrics (Recall@10, NDCG@10, containment); counts such as the users evaluated are not curves
    metrics = [k for k in keys if k not in losses and all(0 <= r[k] <= 1 for r in history)]
    fig, axes = plt.subplots(1, 2 if metrics else 1, figsize=(11 if metrics else 6.5, 4.6), squeeze=False)
    epochs = [float(r["epoch"]) for r in history]
    ax = axes[0][0]
    for i, key in enumerate(losses):
        style = BASELINE_STYLE if key == "train_loss" else {"color": PALETTE[i % len(PALETTE)], "marker": "o"}
        ax.plot(epochs, [r[key] for r in history], label=LOSS_LABELS.get(key, key), **style)
    per_token = any(k in ("train_loss", "valid_loss") for k in losses)
    ax.set_ylabel("loss (cross-entropy, nats per labelled token)" if per_token else "loss")
    ax.set_title("losses per epoch", fontsize=8)
    if metrics:
        ax_m = axes[0][1]
        for i, key in enumerate(metrics):
            ax_m.plot(epochs, [r[key] for r in history], marker="o",
                      color=MODEL_COLOR if i == 0 else PALETTE[i % len(PALETTE)],
                      label=METRIC_LABELS.get(key, key.replace("recall", "Recall").replace("ndcg", "NDCG")))
        ax_m.set_ylabel("validation metric (0 to 1)")
        ax_m.set_title("validation metrics per epoch (the selection's)", fontsize=8)
    best = data.get("best_epoch") or (data.get("best") or {}).get("epoch")  # a draft head records its best row
    for a in axes[0]:
        if isinstance(best, int) and best > 0:
            a.axvline(best, color="black", linestyle=":", linewidth=0.8, label=f"selected: epoch {best}")
        a.set_xlabel("epoch (passes over the training windows)")
        if all(e == int(e) for e in epochs):
            a.set_xticks(sorted(set(epochs)))
        a.legend(fontsize=7)
    conf = data.get("config") or {}
    chosen = data.get("best") or {}
    what = (f"draft head ({data.get('method', '?')})" if "head" in data
            else f"drafter ({data['method']})" if data.get("method") else "target")
    parts = [f"{data['preset']} preset"] if data.get("preset") else []
    if isinstance(data.get("params"), (int, float)):
        parts.append(f"{data['params'] / 1e6:.2f}M parameters")
    if chosen.get("metric"):
        parts.append(f"best {chosen['metric']} {chosen.get('value', float('nan')):.4f}")
    if data.get("stopped"):
        parts.append(f"stopped by {data['stopped']}")
    refit = data.get("refit")
    if isinstance(refit, dict):
        parts.append(f"then refit on train + valid for {refit.get('epochs', '?')} epoch(s) (not plotted)")
    precision = None
    if "bf16" in conf:  # --bf16: auto = on where the device computes bf16 natively (AVX512-BF16, AMX, CUDA)
        precision = ("fp32 weights, bf16 autocast where the device has native bf16" if conf["bf16"] == "auto"
                     else f"fp32 weights, bf16 autocast {conf['bf16']}")
    title(fig, f"training curves of the {what} ({path.parent.name}/{path.name})", ctx, None, precision,
          ", ".join(parts))
    return save(fig, out_dir, f"{name}_curves", formats)
