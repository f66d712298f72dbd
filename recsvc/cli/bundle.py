"""``recsvc bundle attributes``: item attributes for rules (BUNDLE/attributes.json) from the data's items.json.
``recsvc bundle serving-files``: what serving reads of the data (BUNDLE/popularity.json,
BUNDLE/calibration_histories.json; ``recsvc.bundle.serving_files``) for a bundle built before ``recsvc build``
wrote them.

No model is touched: re-run it (or write the file some other way, e.g. a stock export) whenever the catalog's
metadata changes; a running server re-reads the file when it changes (``recsvc.rules.source``).

    recsvc bundle attributes --bundle artifacts/beauty/bundle --from-title
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recsvc.errors import UserError
from recsvc_base.progress import print_record


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bundle", help="bundle files that need no training (item attributes, serving files)")
    sub = p.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)
    a = sub.add_parser("attributes", help="item attributes for rules from items.json", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--bundle", required=True)
    a.add_argument("--data", help="data directory holding items.json (default: the bundle's)")
    a.add_argument("--items", help="an items.json file (default: DATA/items.json)")
    a.add_argument("--from-title", action="store_true",
                   help="derive brand (where the item has none) and a coarse category from the title")
    a.add_argument("--price-bands", default="10,25,50,100",
                   help="price band edges for items with a price (default: %(default)s)")
    a.add_argument("--out", help="output file (default: BUNDLE/attributes.json)")
    a.set_defaults(func=run_attributes)
    f = sub.add_parser("serving-files", help="popularity and calibration histories into the bundle (serving "
                                             "then never reads the data directory)")
    f.add_argument("--bundle", required=True)
    f.add_argument("--data", help="split data directory the bundle was built from (default: the recorded one)")
    f.set_defaults(func=run_serving_files)


def run_serving_files(args: argparse.Namespace) -> int:
    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.serving_files import write_serving_files
    from recsvc.data.split import load_split_dir

    bundle = Bundle.open(args.bundle)
    data_dir = bundle.resolve_data_dir(args.data)
    if not data_dir.is_dir():
        raise UserError(f"data directory not found: {data_dir} (pass --data DIR)")
    data = load_split_dir(data_dir)
    unknown = set(data.items) - set(bundle.load_ids().item_ids.tolist())
    if unknown:
        raise UserError(f"{data_dir} is not the data of bundle {bundle.root}: its items {sorted(unknown)[:5]} have "
                        "no semantic id in the bundle")
    print_record({"bundle": str(bundle.root), "data": str(data_dir), **write_serving_files(bundle.root, data)})
    return 0


def run_attributes(args: argparse.Namespace) -> int:
    from recsvc.bundle.directory import Bundle
    from recsvc.rules.build import build_attributes, read_items_json

    bundle = Bundle.open(args.bundle)
    items_path = Path(args.items) if args.items else bundle.resolve_data_dir(args.data) / "items.json"
    try:
        edges = [float(x) for x in args.price_bands.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--price-bands takes comma-separated numbers, got {args.price_bands!r}") from None
    if edges != sorted(edges) or len(set(edges)) != len(edges):
        raise UserError(f"--price-bands must be increasing, got {args.price_bands!r}")
    items = read_items_json(items_path)
    catalog = set(bundle.load_ids().item_ids.tolist())
    attrs = build_attributes({i: m for i, m in items.items() if i in catalog}, args.from_title, edges)
    out = Path(args.out) if args.out else bundle.root / "attributes.json"
    attrs.save(out)
    report = {
        "out": str(out),
        "items_file": str(items_path),
        "catalog_items": len(catalog),
        "items_without_metadata": len(catalog - set(items)),
        "attributes": {name: {"items": len(attrs.values[name]), "values": len(attrs.vocabulary(name)),
                              "source": attrs.sources.get(name, "")} for name in attrs.names},
    }
    print_record(report)
    return 0
