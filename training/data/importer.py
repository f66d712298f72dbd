"""A team's own interaction log + item table (CSV or Parquet) -> the split data format (``recsvc data import``).

The same chronological protocol as ``recsvc data prepare-amazon`` (training/data/amazon_raw.py), in order:

1. read the item table (training/data/import_items.py): a duplicate or empty item id is an error;
2. read the log (training/data/import_log.py), each row checked (an empty id, a time that does not parse, a
   rating that is not a number: an error naming the row and the column); ``--min-rating`` keeps rows with
   rating >= it; a row whose item is not in the item table is dropped and counted (``--missing-items error``
   makes it an error); user-item pairs are deduped, the earliest time kept;
3. iterative k-core on users and items (``--kcore``, 5);
4. the split: by global time cut by count (``--split 8:1:1``, the default, as prepare-amazon), then users with
   fewer than 2 train items dropped; or per user (``--split leave-last-out``: the last item test, the one
   before it valid);
5. the catalog: the items of the kept users' interactions in any period (an item first bought in valid or test
   stays: a cold item, as a deployed catalog has), or every item of the table (``--all-items``: items nobody
   interacted with become fresh items);
6. users -> 1..U in the ascending order of their ids; items -> 1..N in a seeded shuffle of the sorted ids;
   ``items.json`` keeps each item's own id as ``asin``;
7. write ``sequential_*.txt`` + ``items.json`` + ``stats.json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recsvc.data.split import SPLITS, ItemMeta, write_split_dir
from recsvc.errors import UserError
from training.data.amazon_raw import shuffled_ids
from training.data.columns import Columns
from training.data.import_items import ITEM_COLUMNS, read_items
from training.data.import_log import LOG_COLUMNS, scan_log
from training.data.tabular import open_table
from training.data.time_split import TimeSplit, kcore, split_by_global_time, split_leave_last_out

LEAVE_LAST_OUT = "leave-last-out"


@dataclass(frozen=True)
class ImportConfig:
    kcore: int = 5
    split: tuple[int, int, int] | str = (8, 1, 1)  # ratios of the global-time split, or "leave-last-out"
    seed: int = 2023
    min_train: int = 2
    min_rating: float | None = None
    missing_items: str = "drop"  # or "error"
    all_items: bool = False
    category_sep: str = "|"


def _split(events: list[tuple[float, str, str]], config: ImportConfig) -> TimeSplit[str, str]:
    if config.split == LEAVE_LAST_OUT:
        return split_leave_last_out(events, config.min_train)
    if isinstance(config.split, str):
        raise UserError(f"unknown split {config.split!r}: expected TRAIN:VALID:TEST ratios or {LEAVE_LAST_OUT}")
    return split_by_global_time(events, config.split, config.min_train)


def import_log(log: str | Path, items_file: str | Path, out: str | Path,
               log_cols: Columns = LOG_COLUMNS, item_cols: Columns = ITEM_COLUMNS,
               config: ImportConfig = ImportConfig()) -> dict[str, Any]:
    """Run the pipeline (module docstring); returns the ``stats.json`` content."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out exists and is not a directory: {out}")
    if config.missing_items not in ("drop", "error"):
        raise UserError(f"--missing-items must be drop or error, got {config.missing_items!r}")
    item_table, log_table = open_table(items_file, "item table"), open_table(log, "interaction log")
    catalog = read_items(item_table, item_cols, config.category_sep)
    scan = scan_log(log_table, log_cols, set(catalog), config.min_rating, config.missing_items)
    if not scan.pairs:
        raise UserError(f"{log_table.path}: no usable interaction ({scan.rows} rows, {scan.below_min_rating} "
                        f"below --min-rating, {scan.unknown_item_rows} with items missing from the item table)")
    core = kcore(list(scan.pairs), config.kcore)
    if not core:
        raise UserError(f"no interaction survives the {config.kcore}-core filter ({len(scan.pairs)} before; "
                        "lower --kcore)")
    split = _split([(scan.pairs[p], p[0], p[1]) for p in core], config)
    if not split.train:
        raise UserError(f"no user has >= {config.min_train} train interactions after the split")

    user_ids = {u: idx for idx, u in enumerate(split.users(), start=1)}
    kept = set(catalog) if config.all_items else split.items()
    item_ids = shuffled_ids(list(kept), config.seed)
    items: dict[int, ItemMeta] = {iid: catalog[key] for key, iid in item_ids.items()}
    parts = [
        {user_ids[u]: [item_ids[i] for i in seq] for u, seq in part.items()}
        for part in (split.train, split.valid, split.test)
    ]
    write_split_dir(out, parts[0], parts[1], parts[2], items)

    seen = {i for part in parts for seq in part.values() for i in seq}
    stats: dict[str, Any] = {
        "users": len(user_ids),
        "items": len(item_ids),
        "items_without_interactions": len(item_ids) - len(seen),
        "interactions": {name: sum(map(len, p.values())) for name, p in zip(SPLITS, parts, strict=True)},
        "users_with_items": {name: sum(1 for s in p.values() if s) for name, p in zip(SPLITS, parts, strict=True)},
        "log": {"rows": scan.rows, "below_min_rating": scan.below_min_rating, "duplicates": scan.duplicates,
                "unknown_item_rows": scan.unknown_item_rows, "unknown_items": len(scan.unknown_items),
                "after_dedupe": len(scan.pairs), "after_kcore": len(core)},
        "item_table": {"rows": len(catalog), "without_title": sum(1 for m in catalog.values() if not m.title)},
        "dropped_users": split.dropped_users,
        "dropped_interactions": split.dropped_interactions,
        "params": {**asdict(config), "split": (list(config.split) if isinstance(config.split, tuple)
                                               else config.split),
                   "log": str(log), "items": str(items_file),
                   "columns": dict(log_cols.names), "item_columns": dict(item_cols.names)},
    }
    stats["interactions"]["total"] = sum(stats["interactions"].values())
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    return stats


def summary_line(out: str | Path, stats: dict[str, Any]) -> str:
    """The line ``recsvc data import`` prints on stderr."""
    log = stats["log"]
    return (f"wrote {out}: {stats['users']} users, {stats['items']} items, {stats['interactions']['total']} "
            f"interactions; from {log['rows']} log rows: {log['duplicates']} duplicate pairs, "
            f"{log['below_min_rating']} below --min-rating, {log['unknown_item_rows']} rows dropped for "
            f"{log['unknown_items']} items missing from the item table, {log['after_dedupe'] - log['after_kcore']} "
            f"outside the {stats['params']['kcore']}-core; {stats['dropped_users']} users "
            f"({stats['dropped_interactions']} interactions) with too few train items dropped")


def print_summary(out: str | Path, stats: dict[str, Any]) -> None:
    print(summary_line(out, stats), file=sys.stderr)
