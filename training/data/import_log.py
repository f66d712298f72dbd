"""The interaction log of ``recsvc data import``: one row per interaction (user, item, time; optional rating).

Columns are named by ``--columns user=...,item=...,time=...,rating=...`` (defaults ``user_id``, ``item_id``,
``timestamp``, ``rating``). The rating column is optional: read when present (or when named), needed only by
``--min-rating``. Every value problem is a UserError naming the file, the row and the column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from recsvc.errors import UserError
from training.data.columns import Columns
from training.data.pair_times import PairTimes
from training.data.tabular import Table
from training.data.times import EXPECTED, parse_time

LOG_COLUMNS = Columns("--columns", {"user": "user_id", "item": "item_id", "time": "timestamp", "rating": "rating"})


@dataclass
class LogScan(PairTimes):
    """What reading the log left: ``pairs[(user, item)] = earliest time`` and the counts of rows set aside."""

    rows: int = 0
    unknown_item_rows: int = 0
    unknown_items: set[str] = field(default_factory=set)


def cell_text(value: Any) -> str:
    """An id cell as text: strings stripped, integral numbers without ``.0``, None as ""."""
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _rating(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        rating = float(value)
    except (TypeError, ValueError):
        return None
    return rating if math.isfinite(rating) else None


def scan_log(table: Table, cols: Columns, known_items: set[str], min_rating: float | None,
             missing_items: str) -> LogScan:
    """Read every row (``cols``: :data:`LOG_COLUMNS` as given): check it, filter by rating, dedupe user-item
    pairs (the earliest time wins) and set aside items missing from the item table (``missing_items`` "drop":
    counted; "error": a UserError)."""
    has_rating = bool(cols.require(table, "user", "item", "time", optional=("rating",)))
    if min_rating is not None and not has_rating:
        raise UserError(f"--min-rating needs a rating column: {table.path} has no column {cols['rating']!r} "
                        "(name it with --columns rating=NAME)")
    names = [cols["user"], cols["item"], cols["time"]] + ([cols["rating"]] if has_rating else [])
    scan = LogScan()
    for row, values in table.rows(names):
        scan.rows += 1
        user, item, raw_time = cell_text(values[0]), cell_text(values[1]), values[2]
        if not user:
            raise UserError(f"{table.where(row)}, column {cols['user']!r}: empty user id")
        if not item:
            raise UserError(f"{table.where(row)}, column {cols['item']!r}: empty item id")
        when = parse_time(raw_time)
        if when is None:
            raise UserError(f"{table.where(row)}, column {cols['time']!r}: cannot read {raw_time!r} as a time "
                            f"({EXPECTED})")
        if has_rating:
            rating = _rating(values[3])
            if rating is None and values[3] not in (None, ""):
                raise UserError(f"{table.where(row)}, column {cols['rating']!r}: rating {values[3]!r} is not a number")
            if min_rating is not None and (rating is None or rating < min_rating):
                scan.below_min_rating += 1
                continue
        if item not in known_items:
            if missing_items == "error":
                raise UserError(f"{table.where(row)}, column {cols['item']!r}: item {item!r} is not in the item table "
                                "(--missing-items drop skips such rows)")
            scan.unknown_item_rows += 1
            scan.unknown_items.add(item)
            continue
        scan.add(user, item, when)
    if scan.rows == 0:
        raise UserError(f"{table.path}: no interaction rows")
    return scan
