"""``recsvc data ...``: prepare raw Amazon reviews, synthesize a catalog, print the counts of a data dir.

    recsvc data prepare-amazon --reviews R --meta M --out DIR [--min-rating 4] [--kcore 5] [--split 8:1:1]
    recsvc data synth --out DIR [--items 300] [--users 600] [--seed 0] [--min-len 5] [--max-len 20]
    recsvc data stats --data DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from recsvc.service.arg_types import non_negative_int, positive_int


def _ratios(text: str) -> tuple[int, int, int]:
    from training.data.split import parse_ratios

    try:
        return parse_ratios(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _prepare_amazon(args: argparse.Namespace) -> int:
    from training.data.amazon_raw import PrepareConfig, prepare_amazon

    config = PrepareConfig(min_rating=args.min_rating, kcore=args.kcore, split=args.split, seed=args.seed)
    stats = prepare_amazon(args.reviews, args.meta, args.out, config, progress=not args.quiet)
    print(f"wrote {args.out}: {stats['users']} users, {stats['items']} items, "
          f"{stats['interactions']['total']} interactions; skipped {stats['malformed_lines_skipped']} "
          f"malformed lines (reviews {stats['reviews']['malformed']}, meta {stats['meta']['malformed']})",
          file=sys.stderr)
    _print_json(stats)
    return 0


def _synth(args: argparse.Namespace) -> int:
    from training.data.synth import SynthConfig, write_synth

    config = SynthConfig(n_items=args.items, n_users=args.users, seed=args.seed, min_len=args.min_len,
                         max_len=args.max_len, split=args.split)
    _print_json(write_synth(args.out, config))
    return 0


def _stats(args: argparse.Namespace) -> int:
    from recsvc.data.split import load_split_dir, split_stats

    _print_json(split_stats(load_split_dir(args.data)))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``data`` group to the ``recsvc`` parser."""
    group = subparsers.add_parser(
        "data", help="data pipelines: raw Amazon preparation, synthetic data, stats",
        description=__doc__.splitlines()[0],
    )
    group.set_defaults(func=lambda _args: (group.print_help(sys.stderr), 2)[1])
    sub = group.add_subparsers(dest="data_command", metavar="SUBCOMMAND")

    p = sub.add_parser("prepare-amazon", help="raw Amazon Reviews (2014/2018 JSON lines) -> split data dir")
    p.add_argument("--reviews", required=True, help="reviews file (.json / .json.gz, one review per line)")
    p.add_argument("--meta", required=True, help="metadata file (.json / .json.gz, one item per line)")
    p.add_argument("--out", required=True, help="output data directory")
    p.add_argument("--min-rating", type=float, default=4.0, help="keep reviews with overall >= this (4)")
    p.add_argument("--kcore", type=non_negative_int, default=5, help="iterative k-core on users and items (5)")
    p.add_argument("--split", type=_ratios, default=(8, 1, 1), help="global-time split ratios (8:1:1)")
    p.add_argument("--seed", type=int, default=2023, help="seed of the item id shuffle (2023)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_prepare_amazon)

    s = sub.add_parser("synth", help="synthetic catalog + user sequences with learnable structure")
    s.add_argument("--out", required=True, help="output data directory")
    s.add_argument("--items", type=positive_int, default=300, help="catalog size (300)")
    s.add_argument("--users", type=positive_int, default=600, help="users before the split (600)")
    s.add_argument("--seed", type=int, default=0, help="random seed (0)")
    s.add_argument("--min-len", type=positive_int, default=5, help="shortest user sequence (5)")
    s.add_argument("--max-len", type=positive_int, default=20, help="longest user sequence (20)")
    s.add_argument("--split", type=_ratios, default=(8, 1, 1), help="global-time split ratios (8:1:1)")
    s.set_defaults(func=_synth)

    st = sub.add_parser("stats", help="print a data directory's counts as JSON")
    st.add_argument("--data", required=True, help="data directory (sequential_*.txt + items.json)")
    st.set_defaults(func=_stats)
