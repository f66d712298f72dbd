"""The training options as typed settings: what ``recsvc train`` / ``recsvc build`` flags mean to the training
loop (``TrainConfig``), the target (``train_target`` keywords), LoRA, the dense head and the epoch selection.

The flags themselves are declared by the CLIs (``training/cli.py``); these read the parsed namespace, check it
(bad values are a ``UserError``: exit 2 with a message) and build the settings objects.
"""

from __future__ import annotations

import argparse

from recsvc.errors import UserError


def target_settings(args: argparse.Namespace) -> dict:
    """The target-only options of `recsvc train target` / `recsvc build` as ``train_target`` keywords."""
    refit_epochs = 0 if args.refit_epochs == "auto" else None
    if refit_epochs is None:
        try:
            refit_epochs = int(args.refit_epochs)
        except ValueError:
            raise UserError(f"--refit-epochs must be a number or auto, got {args.refit_epochs!r}") from None
        if refit_epochs < 1:
            raise UserError(f"--refit-epochs must be >= 1 (or auto), got {refit_epochs}")
    if args.max_history is not None and not 1 <= args.max_history <= 100:
        raise UserError(f"--max-history must be in 1..100, got {args.max_history}")
    header = args.prompt if args.prompt != "auto" else ("lcrec" if args.base_model else "compact")
    return {"prompt_header": header, "max_history": args.max_history, "protocol": args.protocol,
            "refit_epochs": refit_epochs, "refit_lr": args.refit_lr, "refit_mode": args.refit_mode,
            "align": getattr(args, "align", "none"), "dense": dense_settings(args),
            "prior_loss": prior_loss_settings(args)}


def prior_loss_settings(args: argparse.Namespace):
    """``PriorLossSettings`` of --prior-loss / --prior-loss-beta, None when off (weight 0)."""
    weight = getattr(args, "prior_loss", 0.0)
    if weight is None or weight == 0:
        return None
    from training.target_lm.prior_loss import PriorLossSettings

    return PriorLossSettings(weight=weight, beta=args.prior_loss_beta).check()


def dense_settings(args: argparse.Namespace):
    """``DenseSettings`` of --dense-head / --dense-temperature, None when the head is off."""
    weight = getattr(args, "dense_head", 0.0)
    if weight is None or weight == 0:
        return None
    from recsvc.content.dense_head import DenseSettings

    if weight < 0 or args.dense_temperature <= 0:
        raise UserError("--dense-head must be >= 0 and --dense-temperature > 0")
    return DenseSettings(weight=weight, temperature=args.dense_temperature)


def loop_config(args: argparse.Namespace):
    """TrainConfig from the flags (also applies --threads)."""
    import torch

    from training.target_lm.budget import default_patience
    from training.target_lm.dropout import check_rate
    from training.target_lm.train import TrainConfig

    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)

    for name in ("epochs", "batch_size", "grad_accum"):
        if getattr(args, name) < 1 and not (name == "epochs" and args.epochs == 0
                                            and getattr(args, "refit_mode", None) == "scratch"):
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 (--epochs 0 only with --refit scratch)")
    if args.lr <= 0:
        raise UserError("--lr must be > 0")
    check_rate(getattr(args, "dropout", 0.0))  # before any data is read
    if args.fit_budget and (args.max_minutes is None or args.max_minutes <= 0):
        raise UserError("--fit-budget sizes the schedule to the budget: give --max-minutes > 0")
    if args.patience is not None and args.patience < 0:
        raise UserError("--patience must be >= 0 (0: off)")
    return TrainConfig(epochs=args.epochs, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                       weight_decay=args.weight_decay, warmup=args.warmup, seed=args.seed,
                       max_minutes=args.max_minutes, patience=default_patience(args.patience, args.fit_budget),
                       bf16=args.bf16, optimizer=args.optimizer, resume=args.resume,
                       fit_budget=args.fit_budget, select=getattr(args, "select", "best"),
                       dropout=getattr(args, "dropout", 0.0))


def evaluator_factory(args: argparse.Namespace):
    """make_evaluator(builder, data) for choosing the epoch on validation Recall@10 (with each user's values, for
    the standard errors of ``training.target_lm.selection``), or None (validation loss). ``recall_users`` None: every
    user."""
    if getattr(args, "select_by", "loss") != "recall":
        return None
    if args.recall_users is not None and args.recall_users < 1:
        raise UserError("--recall-users must be >= 1")
    from functools import partial

    from training.target_lm.selection import make_selection_evaluator

    return partial(make_selection_evaluator, split="valid", k=10, max_users=args.recall_users)


def lora_settings(args: argparse.Namespace):
    from training.target_lm.lora import LoraSettings, parse_targets

    if not args.lora:
        return None
    if args.lora_r < 1:
        raise UserError("--lora-r must be >= 1")
    return LoraSettings(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                        targets=parse_targets(args.lora_targets))
