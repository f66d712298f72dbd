"""``recsvc train dense-head``: the dense head fitted on a trained target whose weights stay as they are
(``recsvc.content.dense_head``; ``backbone: frozen``). The target's beams are then exactly the target's, and the
head only adds its nearest items beside them.

Each of the bundle's targets gets its own head, fitted on the windows of the period it was trained on: the
train-only target (BUNDLE/target-train, or BUNDLE/target of a paper-protocol bundle) on train, a deploy target
on train + valid. The softmax runs over that period's items. Adam on the head alone; the target's hidden states
are computed without gradients (one forward per window, about a third of a training step).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from recsvc.errors import UserError


def train_dense_head(bundle_dir: str | Path, epochs: int = 1, lr: float = 1e-3, temperature: float = 0.07,
                     batch_size: int = 32, window_stride: int = 5, seed: int = 0, dtype: str = "auto",
                     log=print) -> dict[str, Any]:
    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.loading import load_causal_lm
    from recsvc.content.dense_head import DenseHead, DenseSettings, save_dense_head
    from recsvc.data.split import load_split_dir
    from recsvc_base.progress import progress_bar
    from training.target_lm.dense_loss import DenseLoss
    from training.target_lm.sequences import bucketed_batches, collate, train_examples
    from training.target_lm.train import catalog_text_embeddings

    if epochs < 1 or lr <= 0 or temperature <= 0 or batch_size < 1 or window_stride < 1:
        raise UserError("--epochs, --batch-size and --window-stride must be >= 1, --lr and --temperature > 0")
    bundle = Bundle.open(bundle_dir)
    if not bundle.is_done("target"):
        raise UserError(f"{bundle.root} has no trained target: build it first")
    data = load_split_dir(bundle.resolve_data_dir(None))
    ids = bundle.load_ids()
    builder = bundle.prompt_builder(ids=ids)
    items = catalog_text_embeddings(bundle.resolve_data_dir(None), ids)
    deploy = bundle.read().get("protocol", "paper") == "deploy"
    targets = [(bundle.target_dir, "train+valid" if deploy else "train")]
    if deploy and (bundle.train_only_target_dir / "config.json").is_file():
        targets.append((bundle.train_only_target_dir, "train"))
    settings = DenseSettings(weight=0.0, temperature=temperature, backbone="frozen")
    report: dict[str, Any] = {"settings": asdict(settings), "epochs": epochs, "lr": lr, "targets": {}}
    for directory, period in targets:
        start = time.monotonic()
        model = load_causal_lm(directory, dtype=dtype)
        model.requires_grad_(False)
        sequences = data.sequences(period)
        examples = train_examples(builder, sequences, stride=window_stride)
        known = {ids.index_of(i) for seq in sequences.values() for i in seq if i in ids}
        loss_fn = DenseLoss(builder, items, known, settings)
        torch.manual_seed(seed + 7919)
        head = DenseHead(model.config.hidden_size, items.shape[1])
        opt = torch.optim.Adam(head.parameters(), lr=lr)
        steps_total = epochs * len(bucketed_batches([len(e) for e in examples], batch_size, seed=seed))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s, n=steps_total: max(0.0, 1 - s / max(n, 1)))
        history = []
        for epoch in range(epochs):
            batches = bucketed_batches([len(e) for e in examples], batch_size, seed=seed * 1000 + epoch)
            total, count = 0.0, 0
            bar = progress_bar(batches, desc=f"dense head ({directory.name}) epoch {epoch + 1}/{epochs}", leave=False)
            for idx in bar:
                batch = collate([examples[i] for i in idx], 0)
                with torch.no_grad():
                    hidden = model.model(input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"]).last_hidden_state
                loss = loss_fn.dense_term(head, hidden, batch["input_ids"], batch["labels"])
                if loss is None:
                    continue
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                total, count = total + float(loss.detach()), count + 1
                bar.set_postfix(loss=f"{total / count:.3f}")
            history.append({"epoch": epoch + 1, "loss": total / max(count, 1)})
            log(f"dense head ({directory.name}, {period}) epoch {epoch + 1}: loss {total / max(count, 1):.4f}")
        save_dense_head(directory, head, items, settings, known, ids.item_ids.tolist())
        report["targets"][directory.name] = {"period": period, "windows": len(examples), "items": len(known),
                                             "history": history, "seconds": round(time.monotonic() - start, 1)}
    stage = bundle.read().get("stages", {}).get("target", {})
    bundle.update(dense_head={**report, "target_stage_seconds": stage.get("seconds")})
    return report
