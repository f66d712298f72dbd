"""A synthetic raw interaction log and item table, as a team would export them (``recsvc data synth-log``).

The catalog and the users' sequences are those of training/data/synth.py (learnable structure: a successor per
item, leaves, preferred leaves), written *before* any split, so that ``recsvc data import`` has real input:

- ``interactions.csv``: ``user_id,item_id,timestamp,rating`` (ISO-8601 UTC times, ratings 1-5), sorted by time;
- ``items.csv``: ``item_id,title,brand,categories,description`` (categories joined with ``|``);
- the same two tables as ``interactions.parquet`` (timestamps as int64 epoch milliseconds) and ``items.parquet``
  (categories as a list of strings), when Parquet is asked for (pyarrow).

Users are added until the log holds ``interactions`` rows (the last user's sequence is cut). A share of the
catalog (``new_share``) launches during the year, at a time drawn in its last half: nobody takes such an item
before its launch, so the latest launches are first taken in the valid or test period, as the cold items of a
real catalog are. Deterministic for a seed.
"""

from __future__ import annotations

import csv
import random
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from training.data.synth import UserSequences, make_catalog
from training.data.tabular import pyarrow_parquet

START = 1_704_067_200  # 2024-01-01T00:00:00Z
HORIZON_S = 365 * 24 * 3600
FORMATS = ("csv", "parquet")


@dataclass(frozen=True)
class SynthLogConfig(UserSequences):
    interactions: int = 100_000
    items: int = 2000
    new_share: float = 0.1
    formats: tuple[str, ...] = FORMATS

    def check(self) -> None:
        if self.interactions < 1:
            raise UserError(f"--interactions must be >= 1, got {self.interactions}")
        self.check_lengths(self.items)
        if not 0.0 <= self.new_share < 1.0:
            raise UserError(f"--new-share must lie in [0, 1), got {self.new_share}")
        unknown = sorted(set(self.formats) - set(FORMATS))
        if unknown or not self.formats:
            raise UserError(f"--formats: expected some of {', '.join(FORMATS)}, got {', '.join(self.formats)}")


Row = tuple[str, str, int, int]  # user id, item id, epoch seconds, rating


def synth_rows(config: SynthLogConfig) -> tuple[list[Row], list[dict[str, Any]]]:
    """(log rows sorted by time, item table rows)."""
    config.check()
    rng = random.Random(config.seed)
    cat = make_catalog(config.items, rng)
    launch = {item: START + int(rng.uniform(0.5, 0.98) * HORIZON_S) if rng.random() < config.new_share else START
              for item in sorted(cat.items)}
    rows: list[Row] = []
    user = 0
    while len(rows) < config.interactions:
        user += 1
        seq = config.draw(cat, rng)
        seq = seq[: config.interactions - len(rows)]
        start = rng.uniform(0, 0.6 * HORIZON_S)
        end = rng.uniform(start + 0.3 * HORIZON_S, HORIZON_S)
        times = sorted(START + int(rng.uniform(start, end)) for _ in seq)
        for when, item in zip(times, seq, strict=True):
            if when < launch[item]:
                continue  # not on sale yet
            rating = 5 if rng.random() < 0.6 else rng.randint(1, 4)
            rows.append((f"user{user:07d}", f"SKU{item:07d}", when, rating))
    rows.sort(key=lambda r: (r[2], r[0], r[1]))
    table = []
    for item in sorted(cat.items):
        meta = cat.items[item]
        leaf = meta.categories[-1]
        table.append({"item_id": f"SKU{item:07d}", "title": meta.title, "brand": meta.brand,
                      "categories": list(meta.categories),
                      "description": f"{meta.title}. A {leaf.lower()} from {meta.brand}."})
    return rows, table


def _iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_synth_log(out: str | Path, config: SynthLogConfig) -> dict[str, Any]:
    """Write the files (module docstring) under ``out``; returns what was written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out exists and is not a directory: {out}")
    pq = pyarrow_parquet() if "parquet" in config.formats else None
    rows, items = synth_rows(config)
    out.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    if "csv" in config.formats:
        with (out / "interactions.csv").open("w", encoding="utf-8", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["user_id", "item_id", "timestamp", "rating"])
            writer.writerows((u, i, _iso(t), r) for u, i, t, r in rows)
        with (out / "items.csv").open("w", encoding="utf-8", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["item_id", "title", "brand", "categories", "description"])
            writer.writerows((m["item_id"], m["title"], m["brand"], "|".join(m["categories"]), m["description"])
                             for m in items)
        files += ["interactions.csv", "items.csv"]
    if pq is not None:
        import pyarrow as pa

        log = pa.table({"user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows],
                        "timestamp": pa.array([r[2] * 1000 for r in rows], type=pa.int64()),
                        "rating": pa.array([r[3] for r in rows], type=pa.int8())})
        pq.write_table(log, out / "interactions.parquet")
        table = pa.table({key: [m[key] for m in items]
                          for key in ("item_id", "title", "brand", "categories", "description")})
        pq.write_table(table, out / "items.parquet")
        files += ["interactions.parquet", "items.parquet"]
    return {"out": str(out), "files": files, "interactions": len(rows), "users": len({r[0] for r in rows}),
            "items": len(items), "items_interacted": len({r[1] for r in rows}),
            "params": {**asdict(config), "formats": list(config.formats)}}
