"""`recsvc eval --bundle B --split valid|test --k 1,5,10,20 --json FILE`: Recall@K / NDCG@K beside popularity."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recsvc.errors import UserError


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--k takes comma-separated integers, got {text!r}") from None
    if not ks or ks[0] < 1 or ks[-1] > 100:
        raise UserError(f"--k values must lie in 1..100, got {text!r}")
    return ks


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="offline Recall@K / NDCG@K of a bundle's target vs popularity")
    p.add_argument("--bundle", required=True, help="bundle directory")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--k", default="1,5,10,20", help="cutoffs, comma-separated (beam size = the largest)")
    p.add_argument("--data", help="data directory (default: the one recorded in the bundle)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-users", type=int, help="evaluate a fixed random sample of users")
    p.add_argument("--exclude-history", action="store_true", help="never recommend a user's history items")
    p.add_argument("--json", dest="json_path", help="write the metrics here")
    p.set_defaults(func=cmd_eval)


def format_table(result: dict) -> str:
    lines = ["| metric | model | popularity |", "| --- | --- | --- |"]
    for k in result["ks"]:
        for m in ("recall", "ndcg"):
            key = f"{m}@{k}"
            lines.append(f"| {key} | {result['model'][key]:.4f} | {result['popularity'][key]:.4f} |")
    return "\n".join(lines)


def cmd_eval(args: argparse.Namespace) -> int:
    from training.evaluate import evaluate_bundle

    if args.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    if args.max_users is not None and args.max_users < 1:
        raise UserError("--max-users must be >= 1")
    result = evaluate_bundle(args.bundle, args.split, parse_ks(args.k), args.data, args.dtype, args.batch_size,
                             args.max_users, args.exclude_history)
    print(f"{args.split}: {result['users']} users, {result['ms_per_user']} ms/user ({args.dtype})")
    print(format_table(result))
    if args.json_path:
        flat = {**{k: v for k, v in result.items() if k not in ("model", "popularity")}, **result["model"],
                **{f"popularity_{k}": v for k, v in result["popularity"].items()}}
        Path(args.json_path).write_text(json.dumps(flat, indent=1))
    return 0
