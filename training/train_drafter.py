"""The drafter stage: a small LLaMA on the target's tokenizer, trained into BUNDLE/drafter.

``sft``: plain next-item cross-entropy on the same whole-sequence windows as the target (ALGORITHMS.md
section 5, the baseline every alignment method is compared with).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from training.train_target import TrainConfig, _best_entry, fit_causal_lm

METHODS = ("sft",)


def train_drafter(
    bundle_dir: str | Path, data_dir: str | Path | None = None, preset: str = "drafter-small", method: str = "sft",
    cfg: TrainConfig | None = None, eval_max_users: int | None = 2000, window_stride: int = 1,
    force: bool = False,
) -> dict[str, Any]:
    import torch
    from accelerate import PartialState

    from recsvc.model.bundle import Bundle
    from recsvc.model.loading import save_causal_lm
    from recsvc.model.presets import get_preset, new_model
    from recsvc.model.prompt import PromptBuilder
    from training.data.dataset import load_split_dir
    from training.sequences import count_tokens, eval_examples, train_examples

    if method not in METHODS:
        raise UserError(f"unknown drafter method {method!r}: expected one of {', '.join(METHODS)}")
    cfg = cfg or TrainConfig()
    p = get_preset(preset)
    if p.role != "drafter":
        raise UserError(f"{preset!r} is a target preset; drafter presets: drafter-tiny, drafter-small, llama-68m")
    dist = PartialState(cpu=not torch.cuda.is_available())
    bundle = Bundle.open(bundle_dir)
    data_path = data_dir or bundle.data_dir()
    if data_path is None:
        raise UserError(f"bundle {bundle_dir} records no data directory: pass --data DIR")
    data = load_split_dir(data_path)
    ckpt = bundle.checkpoint_dir("drafter")
    if force and dist.is_main_process:
        shutil.rmtree(ckpt, ignore_errors=True)
        bundle.clear_stage("drafter")
    elif not force and (ckpt / "last").is_dir() and not cfg.resume:
        raise UserError(f"{ckpt} holds a checkpoint: pass --resume to continue or --force to start over")
    builder = PromptBuilder(bundle.load_tokenizer(), bundle.load_ids())
    train = train_examples(builder, data.train, stride=window_stride)
    valid = eval_examples(builder, data.eval_users("valid"), max_users=eval_max_users, seed=cfg.seed)
    tokens, _ = count_tokens(train)
    model = new_model(p, builder.tokenizer, seed=cfg.seed)
    n_params = sum(x.numel() for x in model.parameters())
    if dist.is_main_process:
        print(f"drafter: {p.name} ({n_params / 1e6:.2f}M parameters), method {method}, {tokens} tokens/epoch")
    best, result = fit_causal_lm(model, train, valid, cfg, ckpt, builder.tokenizer.pad_token_id, None,
                                 desc=f"drafter[{method}]")
    info = {"seconds": round(result.seconds, 1), "preset": p.name, "method": method, "params": n_params,
            "epochs": result.epochs, "best_epoch": result.best_epoch, "best": _best_entry(result),
            "stopped": result.stopped, "train_tokens_per_s": round(result.train_tokens_per_s, 1),
            "config": asdict(cfg)}
    if dist.is_main_process:
        save_causal_lm(best, bundle.drafter_dir)
        (bundle.drafter_dir / "training.json").write_text(json.dumps({**info, "history": result.history},
                                                                     indent=1, default=str))
        bundle.update(drafter={"preset": p.name, "method": method})
        bundle.mark_done("drafter", **{k: v for k, v in info.items() if k != "config"})
    return info
