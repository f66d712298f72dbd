"""``recsvc train items``: the item-level target (a timeline over items and a small code decoder) trained on a
split with given semantic ids, its epoch chosen on validation; or, with ``--bundle``, a bundle's target stage.

    recsvc train items --data data/beauty --ids artifacts/beauty/ids/semantic_ids.json --out artifacts/items \\
        --threads 1
    recsvc train items --bundle artifacts/beauty/bundle --protocol deploy --threads 1

With ``--bundle`` (the recipe's target stage for ``architecture: items``): the split and the ids are the bundle's;
the epoch is chosen on validation by a run on the train period (BUNDLE/target-train), then, under the deploy
protocol, a fresh model is trained that many epochs on train + valid (BUNDLE/target); bundle.json records the
architecture, the protocol and the stage.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from recsvc.errors import UserError
from recsvc.hardware import native_bf16
from recsvc.timeline.config import TimelineConfig
from training.choices import BF16_MODES, FIT_PERIODS, PROTOCOLS

if TYPE_CHECKING:
    from training.item_target.train import ItemTrainConfig

DEFAULT_MODEL = TimelineConfig()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", type=Path, default=None,
                   help="train the bundle's target stage (its split and ids; --data overrides its split)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="deploy",
                   help="--bundle: deploy (the chosen epochs again on train + valid, from scratch) or paper (the "
                        "train-period model is served)")
    p.add_argument("--data", type=Path, default=None, help="split data directory")
    p.add_argument("--ids", type=Path, default=None, help="semantic_ids.json of the catalog")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for timeline.json / timeline.safetensors (without --bundle)")
    p.add_argument("--fit-on", choices=FIT_PERIODS, default="train",
                   help="train: the epoch chosen on valid; train+valid: a fixed --epochs, no selection")
    p.add_argument("--epochs", type=int, default=30, help="epochs of the schedule (the cosine anneals over them)")
    p.add_argument("--batch-size", type=int, default=128, help="windows per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--dropout", type=float, default=DEFAULT_MODEL.dropout,
                   help="dropout on the item inputs and the decoder's state input while training")
    p.add_argument("--hidden", type=int, default=DEFAULT_MODEL.hidden)
    p.add_argument("--layers", type=int, default=DEFAULT_MODEL.layers, help="timeline layers")
    p.add_argument("--heads", type=int, default=DEFAULT_MODEL.heads)
    p.add_argument("--decoder-layers", type=int, default=DEFAULT_MODEL.decoder_layers)
    p.add_argument("--max-items", type=int, default=DEFAULT_MODEL.max_items, help="history positions read")
    p.add_argument("--item-embedding", action="store_true",
                   help="add a learnt per-item input embedding to the codes' sum (items never trained on: none)")
    p.add_argument("--crop", type=float, default=0.0, help="share of windows replaced by a random crop per epoch")
    p.add_argument("--patience", type=int, default=5, help="epochs without a better valid NDCG@10 (0: off)")
    p.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget; stops after an epoch")
    p.add_argument("--bf16", choices=BF16_MODES, default="auto", help="bf16 autocast (auto: where the CPU has it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def run(args: argparse.Namespace) -> int:
    import torch

    for name in ("epochs", "batch_size", "hidden", "layers", "heads", "decoder_layers", "max_items"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.dropout < 1 or not 0 <= args.crop <= 1:
        raise UserError("--dropout must lie in [0, 1) and --crop in [0, 1]")
    if args.hidden % args.heads:
        raise UserError(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.bundle is None and (args.data is None or args.ids is None or args.out is None):
        raise UserError("give --bundle, or --data, --ids and --out")
    if args.ids is not None and not args.ids.is_file():
        raise UserError(f"semantic ids not found: {args.ids}")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.bundle is not None:
        return _run_bundle(args)
    from recsvc.data.split import load_split_dir
    from tokenizer_rqvae.ids import SemanticIds
    from training.item_target.train import train_item_target

    ids = SemanticIds.load(args.ids)
    model, config = _configs(args, ids)
    record = train_item_target(load_split_dir(args.data), ids, model, config, args.out)
    print(json.dumps(_summary(args.out, record, config.bf16)))
    return 0


def _configs(args: argparse.Namespace, ids) -> tuple[TimelineConfig, ItemTrainConfig]:
    from training.item_target.train import ItemTrainConfig

    model = TimelineConfig(levels=ids.levels, codebook_size=ids.codebook_size, hidden=args.hidden,
                           layers=args.layers, heads=args.heads, ffn=2 * args.hidden,
                           decoder_layers=args.decoder_layers, max_items=args.max_items, dropout=args.dropout,
                           num_items=len(ids) + 1 if args.item_embedding else 0)
    bf16 = args.bf16 == "on" or (args.bf16 == "auto" and native_bf16())
    config = ItemTrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, crop=args.crop,
                             seed=args.seed, patience=args.patience, max_minutes=args.max_minutes, bf16=bf16,
                             fit_periods=args.fit_on)
    return model, config


def _summary(out: Path, record: dict, bf16: bool) -> dict:
    return {"out": str(out), "chosen_epoch": record["chosen_epoch"],
            "valid": {k: round(v, 4) for k, v in record["chosen_valid"].items()},
            "seconds": record["seconds"], "bf16": bf16}


def _run_bundle(args: argparse.Namespace) -> int:
    """The bundle's target stage: selection on the train period, then the deploy refit (or the paper protocol)."""
    import shutil
    import time
    from dataclasses import replace

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.serving_files import write_serving_files
    from recsvc.data.split import load_split_dir
    from training.item_target.train import train_item_target

    bundle = Bundle.open(args.bundle)
    data = load_split_dir(bundle.resolve_data_dir(args.data))
    ids = bundle.load_ids()
    model, config = _configs(args, ids)
    t0 = time.monotonic()
    chosen = train_item_target(data, ids, model, replace(config, fit_periods="train"), bundle.train_only_target_dir)
    info = {"selection": _summary(bundle.train_only_target_dir, chosen, config.bf16)}
    print(json.dumps(info["selection"]))
    if args.protocol == "deploy":
        refit = replace(config, fit_periods="train+valid", epochs=chosen["chosen_epoch"], patience=0,
                        max_minutes=None)
        last = train_item_target(data, ids, model, refit, bundle.target_dir)
        info["refit"] = {"epochs": len(last["epochs"]), "seconds": last["seconds"]}
    else:
        shutil.rmtree(bundle.target_dir, ignore_errors=True)
        shutil.copytree(bundle.train_only_target_dir, bundle.target_dir)
    info["seconds"] = round(time.monotonic() - t0, 1)
    bundle.update(architecture="items", protocol=args.protocol, target_preset=None)
    bundle.mark_done("target", **info)
    write_serving_files(bundle.root, data)
    print(json.dumps({"bundle": str(bundle.root), "architecture": "items", **info}))
    return 0
