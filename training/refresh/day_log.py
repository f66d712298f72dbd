"""The interactions appended since yesterday's bundle (CSV or Parquet, ``recsvc data import``'s columns and rules):
each row's user and item by the team's keys, the time, an optional rating.

The importer's rules apply: a row is checked (an empty id, a time that does not parse: a UserError naming the
row and the column), ``--min-rating`` keeps rows rated at least that, user-item pairs are deduped (the earliest
time kept), and a row whose item key is not in the catalog is dropped and counted (``missing_items="error"``:
a UserError).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.data.columns import Columns
from training.data.import_log import LOG_COLUMNS, scan_log
from training.data.tabular import open_table


@dataclass(frozen=True)
class DayLog:
    """``events``: (time, user key, item key), one per user-item pair, in time order (ties: user, item)."""

    path: Path
    events: list[tuple[float, str, str]]
    rows: int
    duplicates: int
    below_min_rating: int
    unknown_item_rows: int
    unknown_items: tuple[str, ...]

    def counts(self) -> dict[str, int]:
        return {"rows": self.rows, "pairs": len(self.events), "duplicates": self.duplicates,
                "below_min_rating": self.below_min_rating, "unknown_item_rows": self.unknown_item_rows,
                "unknown_items": len(self.unknown_items)}


def read_day_log(path: str | Path, item_keys: set[str], cols: Columns = LOG_COLUMNS,
                 min_rating: float | None = None, missing_items: str = "drop") -> DayLog:
    """The appended log, its items named by ``item_keys`` (the catalog's keys)."""
    table = open_table(path, "appended interactions")
    scan = scan_log(table, cols, item_keys, min_rating, missing_items)
    events = sorted((when, user, item) for (user, item), when in scan.pairs.items())
    return DayLog(Path(path), events, scan.rows, scan.duplicates, scan.below_min_rating, scan.unknown_item_rows,
                  tuple(sorted(scan.unknown_items)))
