"""``recsvc tokenizer build|assign``: semantic ids for a catalog, and for new (cold-start) items.

    recsvc tokenizer build --data DIR --out DIR [--epochs E] [--seed S] [--model PATH] [--cache-dir D]
                           [--resume] [--device cpu|cuda] [--sinkhorn] [--known-through train|valid]
                           [--cf-embeddings SASREC.safetensors --cf-weight W] [--quiet]
    recsvc tokenizer assign --ids DIR --items NEW_ITEMS.json --out FILE [--model PATH] [--cache-dir D]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from recsvc_base.errors import UserError

CF_WEIGHT = 0.1  # the collaborative term's weight with --cf-embeddings (chosen on Beauty's validation period)


def _non_negative(value: str) -> int:
    try:
        v = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from exc
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _non_negative_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from exc
    if not (v >= 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {value}")
    return v


def _positive(value: str) -> int:
    v = _non_negative(value)
    if v == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("tokenizer", help="item tokenizer: RQ-VAE semantic ids")
    sub = group.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    group.set_defaults(func=lambda args: _help(group))

    b = sub.add_parser("build", help="train the RQ-VAE on DIR/items.json and write collision-free ids")
    b.add_argument("--data", required=True, help="data directory with items.json")
    b.add_argument("--out", required=True, help="output directory (semantic_ids.json, rqvae.*, report.json)")
    b.add_argument("--epochs", type=_non_negative, default=None, help="training epochs (default: RQVAEConfig)")
    b.add_argument("--seed", type=_non_negative, default=None, help="random seed (default 0)")
    b.add_argument("--batch-size", type=_positive, default=None, help="training batch size (default 1024)")
    b.add_argument("--model", default=None, help="sentence-transformers model dir (default: packaged MiniLM)")
    b.add_argument("--cache-dir", default=None,
                   help="embedding cache (default $RECSVC_CACHE_DIR or ~/.cache/recsvc/embeddings)")
    b.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--sinkhorn", action="store_true",
                   help="colliding items first try a Sinkhorn-balanced last code (LC-Rec)")
    b.add_argument("--known-through", choices=["train", "valid"], default=None,
                   help="cold-start protocol: fit the RQ-VAE on the items interacted with up to this split; the "
                        "others get ids from the fitted encoder (listed in OUT/assigned_later.json)")
    b.add_argument("--cf-embeddings", default=None,
                   help="a fitted SASRec (recsvc's safetensors format): LETTER-style collaborative regularisation "
                        "of the ids (fit it on the --known-through period or earlier)")
    b.add_argument("--cf-weight", type=_non_negative_float, default=None,
                   help=f"weight of the collaborative term (default {CF_WEIGHT} with --cf-embeddings; 0: text only)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=_build)

    a = sub.add_parser("assign", help="ids for new items, unique against an existing catalog")
    a.add_argument("--ids", required=True, help="directory written by `tokenizer build`")
    a.add_argument("--items", required=True, help="items.json of the new items")
    a.add_argument("--out", required=True, help="merged semantic_ids.json to write")
    a.add_argument("--model", default=None, help="embedding model dir (default: the one used by build)")
    a.add_argument("--cache-dir", default=None, help="embedding cache directory")
    a.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a.add_argument("--quiet", action="store_true")
    a.set_defaults(func=_assign)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _build(args: argparse.Namespace) -> int:
    from tokenizer_rqvae.build import build_semantic_ids, summary_line
    from tokenizer_rqvae.rqvae import RQVAEConfig, with_overrides

    if args.model is not None and not Path(args.model).expanduser().is_dir():
        raise UserError(f"--model: directory not found: {args.model}")
    if args.cf_weight is not None and args.cf_embeddings is None:
        raise UserError("--cf-weight needs --cf-embeddings (the SASRec whose item table the ids are aligned with)")
    cf_weight = args.cf_weight if args.cf_weight is not None or args.cf_embeddings is None else CF_WEIGHT
    config = with_overrides(RQVAEConfig(), epochs=args.epochs, seed=args.seed, batch_size=args.batch_size,
                            cf_weight=cf_weight)
    report = build_semantic_ids(
        args.data, args.out, config, model_path=args.model, cache_dir=args.cache_dir, resume=args.resume,
        device=args.device, sinkhorn_collisions=args.sinkhorn, progress=not args.quiet,
        known_through=args.known_through, cf_embeddings=args.cf_embeddings,
    )
    print(summary_line(report))
    print(f"wrote {Path(args.out) / 'semantic_ids.json'} and report.json")
    return 0


def _assign(args: argparse.Namespace) -> int:
    from tokenizer_rqvae.assign import assign_new_items

    if args.model is not None and not Path(args.model).expanduser().is_dir():
        raise UserError(f"--model: directory not found: {args.model}")
    report = assign_new_items(args.ids, args.items, args.out, model_path=args.model, cache_dir=args.cache_dir,
                              device=args.device, progress=not args.quiet)
    print(json.dumps(report))
    return 0
