"""Training the item-level target: every history position an example, full-codebook cross-entropy per level,
the epoch chosen on validation NDCG@10 (history excluded, the served rule), checkpoints to resume from.

The loss of a batch is the mean over its real positions and the L levels of -log p(c_l | h_t, c_<l) with the
next item's codes teacher-forced: the decoder's rows (one per real position, length L) are batched across all
positions of all windows. The decoder at t reads h_t only (never h_{t+1}); padding positions carry no loss.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from recsvc.data.split import SplitData
from recsvc.timeline.model import TimelineConfig, TimelineModel
from recsvc_base.progress import print_record
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie
from training.item_target.evaluate import validation_figures
from training.item_target.examples import Batch, epoch_batches, windows

CHECKPOINT = "checkpoint.safetensors"
RECORD = "training.json"


@dataclass(frozen=True)
class ItemTrainConfig:
    epochs: int = 30
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: float = 0.02  # share of the steps
    crop: float = 0.0  # share of windows replaced by a random crop each epoch
    seed: int = 0
    patience: int = 5  # epochs without a better validation NDCG@10 before stopping (0: off)
    max_minutes: float | None = None  # wall-clock budget of the loop (validation included)
    bf16: bool = False  # bf16 autocast (CPU with native bf16, or CUDA)
    fit_periods: str = "train"  # "train" (selection) or "train+valid" (the deploy refit: a fixed epoch count)
    eval_width: int = 20
    validate: bool = True  # score validation each epoch and keep the best (False: no validation, the last epoch)
    init: str | None = None  # a TimelineModel directory whose weights the model starts from (a refresh), or None


def batch_loss(model: TimelineModel, batch: Batch) -> torch.Tensor:
    """The mean code cross-entropy of one batch (a scalar)."""
    h = model.states(batch.codes, batch.rows)  # [B, T, H]
    real = batch.targets[..., 0] >= 0  # [B, T]
    state, target = h[real], batch.targets[real]  # [N, H], [N, L]
    logits = model.code_logits(state, target[:, :-1])  # [N, L, C]
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def train_item_target(data: SplitData, ids: SemanticIds, model_config: TimelineConfig, config: ItemTrainConfig,
                      out: Path, log: Callable[[dict[str, Any]], None] = print_record) -> dict[str, Any]:
    """Trains, keeps the epoch of best validation NDCG@10 (``fit_periods="train"``) or the last one (the refit),
    saves it to ``out`` (``TimelineModel.save``) with ``training.json``, and returns that record. Resumes from
    ``out/checkpoint.safetensors`` when a run with the same configuration left one."""
    torch.manual_seed(config.seed)
    trie = CatalogTrie(ids)
    codes = torch.from_numpy(ids.codes)
    parts = windows(data.sequences(config.fit_periods), ids, model_config.max_items)
    users = data.eval_users("valid") if config.fit_periods == "train" and config.validate else []
    model = TimelineModel(model_config)
    if config.init is not None:  # yesterday's weights: the same codes' vocabulary, so every tensor carries over
        model.load_state_dict(TimelineModel.load(Path(config.init)).state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(parts) / config.batch_size)
    total = steps_per_epoch * config.epochs
    warmup = max(1, int(config.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, total, warmup))
    record: dict[str, Any] = {"model": model_config.to_json(), "train": asdict(config), "epochs": [],
                              "windows": len(parts), "parameters": sum(p.numel() for p in model.parameters())}
    best: tuple[float, int] = (-1.0, -1)
    start_epoch = _resume(out, model, opt, sched, record)
    if record["epochs"]:
        best = max((e["valid"].get("ndcg@10", -1.0), e["epoch"]) for e in record["epochs"])
    t0 = time.perf_counter() - sum(e["seconds"] for e in record["epochs"])
    for epoch in range(start_epoch, config.epochs):
        e0 = time.perf_counter()
        model.train()
        total_loss = 0.0
        batches = epoch_batches(parts, config.batch_size, config.seed * 1000 + epoch, config.crop, codes)
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
                loss = batch_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total_loss += float(loss.detach())
        train_s = time.perf_counter() - e0
        valid = validation_figures(model, trie, users, config.eval_width) if users else {}
        entry = {"epoch": epoch + 1, "loss": round(total_loss / max(1, len(batches)), 4), "train_s": round(train_s, 1),
                 "seconds": round(time.perf_counter() - e0, 1), "valid": valid}
        record["epochs"].append(entry)
        log({"epoch": entry["epoch"], "loss": entry["loss"], "train_s": entry["train_s"],
             **{k: round(v, 4) for k, v in valid.items() if k in ("recall@10", "ndcg@10")}})
        if not users or valid["ndcg@10"] > best[0]:
            best = (valid.get("ndcg@10", 0.0), epoch + 1)
            model.save(out)
        _checkpoint(out, model, opt, sched, record)
        stop = config.patience and users and epoch + 1 - best[1] >= config.patience
        late = config.max_minutes is not None and time.perf_counter() - t0 > 60 * config.max_minutes
        if stop or late:
            record["stopped"] = "patience" if stop else "budget"
            break
    record["chosen_epoch"] = best[1]
    record["chosen_valid"] = next((e["valid"] for e in record["epochs"] if e["epoch"] == best[1]), {})
    record["seconds"] = round(time.perf_counter() - t0, 1)
    (out / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record


def _checkpoint(out: Path, model: TimelineModel, opt: torch.optim.Optimizer, sched: Any,
                record: dict[str, Any]) -> None:
    """The model, the optimiser's moments and the record after an epoch (safetensors + JSON: nothing pickled)."""
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    state = opt.state_dict()
    for i, s in state["state"].items():
        for name, v in s.items():
            tensors[f"opt.{i}.{name}"] = torch.as_tensor(v).contiguous()
    save_file(tensors, str(out / CHECKPOINT))
    (out / "checkpoint.json").write_text(json.dumps({"record": record, "sched": sched.state_dict()["last_epoch"]}))


def _resume(out: Path, model: TimelineModel, opt: torch.optim.Optimizer, sched: Any,
            record: dict[str, Any]) -> int:
    """The epoch to start from: 0, or the one after a checkpoint of the same configuration."""
    meta_path, weights = out / "checkpoint.json", out / CHECKPOINT
    if not meta_path.is_file() or not weights.is_file():
        out.mkdir(parents=True, exist_ok=True)
        return 0
    meta = json.loads(meta_path.read_text())
    old = meta["record"]
    if old["model"] != record["model"] or old["train"] != record["train"]:
        return 0
    tensors = load_file(str(weights))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    groups = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": groups["param_groups"]})
    sched.last_epoch = meta["sched"]
    for g, lr in zip(opt.param_groups, [sched.lr_lambdas[0](meta["sched"]) * b for b in sched.base_lrs],
                     strict=True):
        g["lr"] = lr
    record["epochs"] = old["epochs"]
    return len(old["epochs"])
