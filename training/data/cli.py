"""``recsvc data ...``: prepare raw Amazon reviews or a team's own log, synthesize data, print a data dir's counts.

    recsvc data prepare-amazon --reviews R --meta M --out DIR [--min-rating 4] [--kcore 5] [--split 8:1:1]
    recsvc data import --log LOG --items ITEMS --out DIR [--columns user=U,item=I,time=T,rating=R]
        [--item-columns id=..,title=..] [--kcore 5] [--split 8:1:1|leave-last-out] [--missing-items drop|error]
    recsvc data synth-log --out DIR [--interactions 100000] [--items 2000] [--formats csv,parquet]
    recsvc data synth --out DIR [--items 300] [--users 600] [--seed 0] [--min-len 5] [--max-len 20]
    recsvc data stats --data DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from recsvc.service.arg_types import non_negative_int, positive_int

if TYPE_CHECKING:
    from training.data.columns import Columns


def _ratios(text: str) -> tuple[int, int, int]:
    from training.data.time_split import parse_ratios

    try:
        return parse_ratios(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _split_arg(text: str) -> tuple[int, int, int] | str:
    from training.data.importer import LEAVE_LAST_OUT

    return LEAVE_LAST_OUT if text == LEAVE_LAST_OUT else _ratios(text)


def columns_arg(columns: Columns) -> Any:
    """An argparse type: ``ROLE=NAME,...`` -> the roles renamed (a bad role: argparse's message)."""
    def parse(text: str) -> dict[str, str]:
        try:
            return columns.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _formats(text: str) -> tuple[str, ...]:
    from training.data.synth_log import FORMATS

    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names or set(names) - set(FORMATS):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(FORMATS)}, got {text!r}")
    return names


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


def _import(args: argparse.Namespace) -> int:
    from training.data.import_items import ITEM_COLUMNS
    from training.data.import_log import LOG_COLUMNS
    from training.data.importer import ImportConfig, import_log, print_summary

    config = ImportConfig(kcore=args.kcore, split=args.split, seed=args.seed, min_rating=args.min_rating,
                          missing_items=args.missing_items, all_items=args.all_items, category_sep=args.category_sep)
    stats = import_log(args.log, args.items, args.out, LOG_COLUMNS.given(args.columns),
                       ITEM_COLUMNS.given(args.item_columns), config)
    print_summary(args.out, stats)
    _print_json(stats)
    return 0


def _synth_log(args: argparse.Namespace) -> int:
    from training.data.synth_log import SynthLogConfig, write_synth_log

    config = SynthLogConfig(interactions=args.interactions, items=args.items, seed=args.seed, min_len=args.min_len,
                            max_len=args.max_len, new_share=args.new_share, formats=args.formats)
    _print_json(write_synth_log(args.out, config))
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
        "data", help="data pipelines: raw Amazon preparation, your own log's import, synthetic data, stats",
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

    from training.data.import_items import ITEM_COLUMNS
    from training.data.import_log import LOG_COLUMNS

    i = sub.add_parser("import", help="your interaction log + item table (CSV or Parquet) -> split data dir "
                                      "(docs/DATA.md)")
    i.add_argument("--log", required=True,
                   help="interaction log, .csv / .tsv (gzipped or not) or Parquet: one row per interaction")
    i.add_argument("--items", required=True, help="item table, CSV or Parquet: one row per item")
    i.add_argument("--out", required=True, help="output data directory")
    i.add_argument("--columns", type=columns_arg(LOG_COLUMNS), default={},
                   help="the log's column names, ROLE=NAME,... with roles user, item, time, rating "
                        "(defaults user_id, item_id, timestamp, rating; rating is optional)")
    i.add_argument("--item-columns", type=columns_arg(ITEM_COLUMNS), default={},
                   help="the item table's column names, ROLE=NAME,... with roles id, title, description, brand, "
                        "categories (defaults item_id, title, description, brand, categories; the last three "
                        "optional)")
    i.add_argument("--category-sep", default="|", help="separator of categories in a text column (|)")
    i.add_argument("--min-rating", type=float, default=None,
                   help="keep rows with rating >= this (default: keep every row; needs a rating column)")
    i.add_argument("--kcore", type=non_negative_int, default=5, help="iterative k-core on users and items (5)")
    i.add_argument("--split", type=_split_arg, default=(8, 1, 1),
                   help="global-time split ratios TRAIN:VALID:TEST (8:1:1, as prepare-amazon), or "
                        "leave-last-out (per user: last item test, the one before valid)")
    i.add_argument("--seed", type=int, default=2023, help="seed of the item id shuffle (2023)")
    i.add_argument("--missing-items", choices=("drop", "error"), default="drop",
                   help="a log row whose item is not in the item table: dropped and counted (drop, the default) "
                        "or an error naming the row (error)")
    i.add_argument("--all-items", action="store_true",
                   help="every item of the table joins the catalog (those nobody interacted with are fresh items); "
                        "default: the items of the kept interactions")
    i.set_defaults(func=_import)

    g = sub.add_parser("synth-log", help="a synthetic raw log + item table (CSV and Parquet) to try `data import`")
    _synthetic_args(g, "output directory", items=2000)
    g.add_argument("--interactions", type=positive_int, default=100_000, help="log rows (100000)")
    g.add_argument("--formats", type=_formats, default=("csv", "parquet"),
                   help="files to write: csv, parquet or both (csv,parquet; parquet needs pyarrow)")
    g.add_argument("--new-share", type=float, default=0.1,
                   help="share of the items launched during the year, first taken late: cold items (0.1)")
    g.set_defaults(func=_synth_log)

    s = sub.add_parser("synth", help="synthetic catalog + user sequences with learnable structure")
    _synthetic_args(s, "output data directory", items=300)
    s.add_argument("--users", type=positive_int, default=600, help="users before the split (600)")
    s.add_argument("--split", type=_ratios, default=(8, 1, 1), help="global-time split ratios (8:1:1)")
    s.set_defaults(func=_synth)

    st = sub.add_parser("stats", help="print a data directory's counts as JSON")
    st.add_argument("--data", required=True, help="data directory (sequential_*.txt + items.json)")
    st.set_defaults(func=_stats)


def _synthetic_args(p: argparse.ArgumentParser, out_help: str, items: int) -> None:
    """The flags both synthetic generators take: where, how many items, the seed, the sequences' lengths."""
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--items", type=positive_int, default=items, help=f"catalog size ({items})")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--min-len", type=positive_int, default=5, help="shortest user sequence (5)")
    p.add_argument("--max-len", type=positive_int, default=20, help="longest user sequence (20)")
