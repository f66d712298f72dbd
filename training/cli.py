"""``recsvc train ...``: model training commands (``target``, ``teacher``, ``drafter``).

    recsvc train target --data data/beauty --bundle artifacts/beauty --preset small
    recsvc train teacher --bundle artifacts/beauty --k 20
    recsvc train drafter --bundle artifacts/beauty --method atspeed-s --alpha 0.5 --out-name atspeed-s
    recsvc train target --data D --bundle B --base-model ~/llama --lora --lora-r 8 --lora-targets q_proj,v_proj
    recsvc train sasrec --data D --fit-on train --out DIR
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from recsvc.bundle.loading import PRECISIONS
from recsvc.bundle.prompt import HEADER_STYLES
from recsvc.engine.kernels.plan import ATTENTIONS
from recsvc.errors import UserError
from recsvc.service.arg_types import positive_int
from recsvc_base.progress import print_record
from training.choices import (
    ALIGN_MODES,
    BF16_MODES,
    FIT_PERIODS,
    METHODS,
    OPTIMIZERS,
    PROTOCOLS,
    REFIT_MODES,
    SUPPORTS,
    VERIFY,
)
from training.item_target import command as items_command
from training.target_lm.selection import SELECT_RULES
from training.target_lm.settings import evaluator_factory, loop_config, lora_settings, target_settings


def add_loop_args(p: argparse.ArgumentParser, epochs: int = 8, lr: float = 1e-3) -> None:
    """Flags of the generic training loop (TrainConfig); shared with `recsvc build`."""
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=32, help="windows per micro-batch (per process)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout while training, on the token embeddings and each attention / MLP output (0: none; "
                        "the served model is the same LLaMA either way)")
    p.add_argument("--warmup", type=float, default=0.05, help="< 1: fraction of the steps; >= 1: steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget; stops cleanly")
    p.add_argument("--fit-budget", action="store_true",
                   help="with --max-minutes: time a few training steps and one validation pass first, then run "
                        "the warmup/cosine schedule over the epochs that fit the budget (at most --epochs), so "
                        "the learning rate has annealed when the budget ends")
    p.add_argument("--patience", type=int, default=None,
                   help="stop after this many epochs without improvement (0: off; default: 2, and off with "
                        "--fit-budget, whose schedule anneals only at its end: the whole schedule runs and --select "
                        "chooses the epoch); an epoch counts against patience when --select does not choose it")
    p.add_argument("--bf16", choices=BF16_MODES, default="auto", help="bf16 autocast")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=OPTIMIZERS[0],
                   help="AdamW implementation: fused (one kernel, the default), or foreach (torch's default one, "
                        "the recipe's before the fused one: it reproduces older runs' steps)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--force", action="store_true", help="discard checkpoints and retrain")
    p.add_argument("--eval-users", type=user_count, default=None, metavar="N|all",
                   help="validation users for the loss (default: every one; N: a fixed seeded sample)")
    p.add_argument("--select-by", choices=["recall", "loss"], default="recall",
                   help="choose the epoch on validation Recall@10 (beam search; drafters: AS@K, "
                        "strict acceptance) or on the loss")
    p.add_argument("--recall-users", type=user_count, default=None, metavar="N|all",
                   help="validation users for the Recall@10 that chooses the epoch (default: every one, so that "
                        "epochs differ beyond noise; N: a fixed seeded sample, cheaper and noisier)")
    p.add_argument("--select", choices=SELECT_RULES, default="within-se",
                   help="within-se: the latest epoch within one paired standard error (over the validation users) "
                        "of the best one, the schedule's end when the epochs do not differ beyond noise; best: the "
                        "highest mean (docs/QUALITY.md, \"Choosing the epoch\")")
    p.add_argument("--window-stride", type=int, default=1,
                   help="targets per window after a user's first (1: exact prompts; 5: ~1.5x faster epochs)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: all cores; 1 is faster on a busy shared machine)")


def user_count(text: str) -> int | None:
    """``--eval-users`` / ``--recall-users``: "all" -> None (every user), else a count >= 1."""
    return None if text.strip().lower() == "all" else positive_int(text)


def add_model_args(p: argparse.ArgumentParser) -> None:
    from recsvc.bundle.presets import TARGET_PRESETS

    p.add_argument("--preset", default="small", choices=TARGET_PRESETS, help="target shape (no --base-model)")
    p.add_argument("--base-model", type=Path, default=None, help="local pretrained LLaMA-family checkpoint")
    p.add_argument("--lora", action="store_true", help="LoRA fine-tuning of --base-model")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--lora-targets", default="q_proj,v_proj", help="comma-separated module names")
    p.add_argument("--prompt", choices=("auto", *HEADER_STYLES), default="auto",
                   help="prompt style: packed ([BOS] + item codes only, no separator: the fewest tokens), compact "
                        "([BOS] + codes and a newline per item), lcrec (LC-Rec's instruction text); auto = "
                        "compact from scratch, lcrec with --base-model")
    p.add_argument("--max-history", type=int, default=None, help="history items in a prompt (default 20)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="paper",
                   help="paper: train on the train period only; deploy: after choosing the epoch on valid, "
                        "continue training on train + valid (what a deployed model should know)")
    p.add_argument("--refit-epochs", default="1",
                   help="deploy: epochs over train + valid; auto: the selected epoch count with --refit scratch "
                        "(the classic refit: the selection run's warmup/cosine schedule, stopped after the chosen "
                        "epoch), 1 with --refit continue")
    p.add_argument("--refit-lr", type=float, default=None,
                   help="deploy: peak lr of the refit (default: lr / 2 to continue, lr from scratch)")
    p.add_argument("--refit", dest="refit_mode", choices=REFIT_MODES, default="continue",
                   help="deploy: continue the chosen model over train + valid, or train a fresh one for "
                        "--refit-epochs (the chosen epoch count; --epochs 0 skips the selection phase)")
    p.add_argument("--align", choices=ALIGN_MODES, default="none",
                   help="text2id: also train LC-Rec's item-index alignment task (an item's text -> its codes) on "
                        "every item of the catalog of the period the model serves (selection: the items "
                        "interacted with by the end of valid; deploy refit: the whole catalog), so that items "
                        "without interactions have learnt code paths too")
    p.add_argument("--dense-head", type=float, default=0.0, metavar="WEIGHT",
                   help="> 0: also train the dense head (LIGER-style: the last hidden state predicts the next "
                        "item's text embedding; a softmax over the fitting period's items at this weight beside the "
                        "LM loss); served beside the beams once `recsvc tune dense` has chosen how to merge them")
    p.add_argument("--dense-temperature", type=float, default=0.07, help="the dense head's softmax temperature")
    p.add_argument("--prior-loss", type=float, default=0.0, metavar="WEIGHT",
                   help="> 0: train the target with the last-item transition prior inside its softmax at this "
                        "weight (leave-one-out counts of the fitting period), so that it learns what the prior it "
                        "is fused with does not say; the epoch is then chosen with that prior fused")
    p.add_argument("--prior-loss-beta", type=float, default=1.0,
                   help="the training prior's popularity back-off pseudo-count (> 0)")


def register(subparsers) -> None:
    train = subparsers.add_parser("train", help="train models into a bundle")
    sub = train.add_subparsers(dest="train_command", metavar="MODEL")
    p = sub.add_parser("target", help="train the target recommender LM (bundle stage 'target')")
    p.add_argument("--data", type=Path, required=True, help="split data directory")
    p.add_argument("--bundle", type=Path, required=True, help="bundle directory (needs ids/)")
    add_model_args(p)
    add_loop_args(p)
    p.set_defaults(func=cmd_target)
    from recsvc.bundle import presets

    d = sub.add_parser("drafter", help="train the drafter LM into the bundle (stage 'drafter')")
    d.add_argument("--bundle", type=Path, required=True, help="bundle directory with ids + tokenizer")
    d.add_argument("--data", type=Path, default=None, help="split data directory (default: the bundle's)")
    d.add_argument("--preset", default="drafter-small", choices=presets.DRAFTER_PRESETS)
    d.add_argument("--method", default="sft", choices=METHODS,
                   help="training objective (all but sft need `recsvc train teacher` first)")
    d.add_argument("--alpha", type=float, default=0.5, help="alpha * L_align + (1 - alpha) * L_rec")
    d.add_argument("--k", type=int, default=None, help="teacher beams per prefix used (default: all stored)")
    d.add_argument("--support", choices=SUPPORTS, default="topk",
                   help="atspeed-r only: TVD over the drafter's top-K allowed codes (the spec) or over every "
                        "trie-allowed code (the paper's 'w/o CA' ablation; the better relaxed drafter on Beauty)")
    d.add_argument("--out-name", default=None,
                   help="save to BUNDLE/drafters/NAME (what `recsvc bench drafters` compares) instead of "
                        "BUNDLE/drafter (the served one)")
    d.add_argument("--init-from", default=None,
                   help="start from a saved drafter: its --out-name (e.g. sft: BUNDLE/drafters/sft), 'drafter' "
                        "(BUNDLE/drafter) or a model directory")
    d.add_argument("--as-users", type=int, default=200,
                   help="validation users for AS@K (strict and relaxed acceptance); the best epoch by AS is kept")
    d.add_argument("--verify", choices=VERIFY, default="auto",
                   help="which validation AS selects the epoch (auto: relaxed for atspeed-r, else strict)")
    d.add_argument("--as-k", type=int, default=10, help="K of the validation AS@K")
    d.add_argument("--gamma", type=int, default=3, help="draft depths per round for the validation AS")
    d.add_argument("--draft-beams", type=int, default=None, help="N for the validation AS (default: K)")
    add_loop_args(d)
    d.set_defaults(func=cmd_drafter)

    t = sub.add_parser("teacher", help="target beams + log-probs per training prefix (BUNDLE/teacher)")
    t.add_argument("--bundle", type=Path, required=True, help="bundle directory with a trained target")
    t.add_argument("--data", type=Path, default=None, help="split data directory (default: the bundle's)")
    t.add_argument("--k", type=int, default=20, help="target beams stored per prefix")
    t.add_argument("--max-prefixes", type=int, default=None, help="a seeded random sample of the prefixes")
    t.add_argument("--batch-size", type=int, default=32, help="prefixes per beam search")
    t.add_argument("--lambda-mix", type=float, default=0.0,
                   help="probability that a prefix's sequences come from the current drafter's own beam search")
    t.add_argument("--shard-size", type=int, default=1024, help="prefixes per shard (the unit of resuming)")
    t.add_argument("--dtype", choices=PRECISIONS, default="auto", help="target (and drafter) precision")
    t.add_argument("--attention", choices=ATTENTIONS, default="fp32",
                   help="the engine's attention mode for the target (fp32: what the service runs)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    t.add_argument("--force", action="store_true", help="discard existing teacher data and rebuild")
    t.set_defaults(func=cmd_teacher)

    h = sub.add_parser("head", help="the recurrent draft head on the target (ReDrafter style; BUNDLE/head)")
    h.add_argument("--bundle", type=Path, required=True, help="bundle directory with a trained target")
    h.add_argument("--method", default="atspeed-s", choices=METHODS,
                   help="distillation objective (the drafter's losses), on the served target's beams")
    h.add_argument("--alpha", type=float, default=0.5, help="alpha * L_align + (1 - alpha) * L_rec")
    h.add_argument("--k", type=int, default=10, help="target beams traced per training prefix (and K of the losses)")
    h.add_argument("--prefixes", type=int, default=20000, help="training prefixes traced (a seeded sample)")
    h.add_argument("--epochs", type=int, default=6)
    h.add_argument("--lr", type=float, default=1e-3)
    h.add_argument("--batch-size", type=int, default=64, help="prefixes per optimizer step")
    h.add_argument("--dtype", choices=PRECISIONS, default="auto", help="the target's precision")
    h.add_argument("--out-name", default=None, help="save to BUNDLE/heads/NAME instead of BUNDLE/head (served)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    h.add_argument("--resume", action="store_true", help="continue from BUNDLE/checkpoints/head")
    h.add_argument("--force", action="store_true", help="discard the head's checkpoints and start over")
    h.set_defaults(func=cmd_head)

    dh = sub.add_parser("dense-head", help="fit the dense head on the bundle's trained targets, their weights "
                                           "unchanged (each on its own period; docs/QUALITY.md)")
    dh.add_argument("--bundle", type=Path, required=True, help="bundle with a trained target")
    dh.add_argument("--epochs", type=int, default=1)
    dh.add_argument("--lr", type=float, default=1e-3)
    dh.add_argument("--temperature", type=float, default=0.07, help="of the softmax over cosine similarities")
    dh.add_argument("--batch-size", type=int, default=32, help="windows per step")
    dh.add_argument("--window-stride", type=int, default=5, help="as the target's windows (the recipe's 5)")
    dh.add_argument("--dtype", choices=PRECISIONS, default="auto", help="the target's precision")
    dh.add_argument("--seed", type=int, default=0)
    dh.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    dh.set_defaults(func=cmd_dense_head)

    s = sub.add_parser("sasrec", help="fit a SASRec on a period (its item table feeds `tokenizer build "
                                      "--cf-embeddings`)")
    s.add_argument("--data", type=Path, required=True, help="split data directory")
    s.add_argument("--fit-on", choices=FIT_PERIODS, default="train",
                   help="the period it learns from (train: epochs chosen on valid)")
    s.add_argument("--out", type=Path, required=True, help="directory for model.safetensors and fit.json")
    s.add_argument("--cache-dir", type=Path, default=Path("artifacts/baselines"),
                   help="the baselines' cache of fitted SASRecs (`recsvc eval` shares it)")
    s.add_argument("--max-minutes", type=float, default=None, help="training budget (default: SASRec's, 30 min)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    s.set_defaults(func=cmd_sasrec)

    it = sub.add_parser("items", help="the item-level target: a timeline over items and a small code decoder, "
                                      "its epoch chosen on valid")
    items_command.add_args(it)
    it.set_defaults(func=items_command.run)
    train.set_defaults(func=lambda _args: train.print_help() or 2)


def cmd_drafter(args: argparse.Namespace) -> int:
    from training.drafters.train import train_drafter

    if args.data is not None and not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    if args.as_users < 0 or args.as_k < 1 or args.gamma < 1:
        raise UserError("--as-users must be >= 0, --as-k and --gamma >= 1")
    select_by = "as" if args.select_by == "recall" and args.as_users > 0 else "loss"
    info = train_drafter(args.bundle, args.data, preset=args.preset, method=args.method, cfg=loop_config(args),
                         eval_max_users=args.eval_users, window_stride=args.window_stride, force=args.force,
                         alpha=args.alpha, k=args.k, select_by=select_by, as_users=args.as_users, as_k=args.as_k,
                         gamma=args.gamma, draft_beams=args.draft_beams, out_name=args.out_name,
                         init_from=args.init_from, verify=args.verify,
                         support=args.support)
    if info.pop("main_process", True):
        print_record({k: v for k, v in info.items() if k != "config"})
    return 0


def cmd_teacher(args: argparse.Namespace) -> int:
    from training.drafters.teacher import build_teacher

    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    if args.data is not None and not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    meta = build_teacher(args.bundle, k=args.k, max_prefixes=args.max_prefixes, batch_size=args.batch_size,
                         lambda_mix=args.lambda_mix, shard_size=args.shard_size, seed=args.seed, dtype=args.dtype,
                         data_dir=args.data, force=args.force, attention=args.attention)
    print_record(meta)
    return 0


def cmd_head(args: argparse.Namespace) -> int:
    from training.drafters.head import train_head

    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    info = train_head(args.bundle, method=args.method, alpha=args.alpha, k=args.k, max_prefixes=args.prefixes,
                      epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed, dtype=args.dtype,
                      out_name=args.out_name, force=args.force, resume=args.resume)
    print_record({k: v for k, v in info.items() if k != "history"})
    return 0


def cmd_dense_head(args: argparse.Namespace) -> int:
    from training.target_lm.dense_head import train_dense_head

    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    info = train_dense_head(args.bundle, epochs=args.epochs, lr=args.lr, temperature=args.temperature,
                            batch_size=args.batch_size, window_stride=args.window_stride, seed=args.seed,
                            dtype=args.dtype)
    print_record(info)
    return 0


def cmd_sasrec(args: argparse.Namespace) -> int:
    import torch

    from recsvc.data.split import load_split_dir
    from training.baselines.sasrec import fit_sasrec
    from training.baselines.sasrec_train import SASRecSettings

    if not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    settings = SASRecSettings()
    if args.max_minutes is not None:
        if not args.max_minutes > 0:
            raise UserError("--max-minutes must be > 0")
        settings = replace(settings, max_minutes=args.max_minutes)
    fitted = fit_sasrec(load_split_dir(args.data), args.fit_on, settings, cache_dir=args.cache_dir)
    out = fitted.save(args.out)
    print(json.dumps({"out": str(out / "model.safetensors"), "fit_on": args.fit_on, "cached": fitted.info["cached"],
                      "fit_seconds": fitted.info.get("fit_seconds")}))
    return 0


def cmd_target(args: argparse.Namespace) -> int:
    from training.target_lm.train import train_target

    if not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    info = train_target(args.data, args.bundle, preset=args.preset, cfg=loop_config(args),
                        base_model=args.base_model, lora=lora_settings(args), force=args.force,
                        eval_max_users=args.eval_users, window_stride=args.window_stride,
                        make_evaluator=evaluator_factory(args), **target_settings(args))
    if info.pop("main_process", True):
        print_record({k: v for k, v in info.items() if k != "config"})
    return 0
