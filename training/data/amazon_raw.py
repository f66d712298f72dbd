"""Raw Amazon Reviews (2014 or 2018 JSON-lines, gzipped or plain) -> the split data format.

Pipeline (``prepare_amazon``), in order:

1. stream the reviews file line by line, keeping only ``(user, item, time)`` of reviews with
   ``overall >= min_rating`` (malformed lines - bad JSON, missing/ill-typed fields - are counted and skipped);
2. dedupe user-item pairs among the kept reviews, keeping the earliest time;
3. iterative k-core: users and items with >= k interactions, repeated until stable;
4. sort every interaction by global time (ties by user id, then item asin) and cut by count 8:1:1 into
   train / valid / test (:func:`training.data.time_split.split_by_global_time`);
5. drop users with < 2 train interactions. The item set is then *the items of the remaining users'
   interactions in any period* (an item seen only in valid/test of a kept user stays: a cold item, as in a
   real deployment); items only used by dropped users disappear;
6. users -> 1..U in ascending order of reviewerID; items -> 1..N in a seeded shuffle of the sorted asins
   (like the shared Beauty split, seed 2023);
7. metadata: the meta file is streamed and only the kept asins are read (title, brand, categories -
   2018 ``category`` list or 2014 ``categories`` list of lists, flattened - and description);
8. write ``sequential_*.txt`` + ``items.json`` (:func:`recsvc.data.split.write_split_dir`) and
   ``stats.json``.

2014 meta lines are Python dict literals, read with :func:`ast.literal_eval` when JSON fails (never eval).
"""

from __future__ import annotations

import ast
import gzip
import html
import json
import random
import sys
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from recsvc.data.split import SPLITS, ItemMeta, write_split_dir
from recsvc.errors import UserError
from training.data.pair_times import PairTimes
from training.data.time_split import kcore, split_by_global_time

DESCRIPTION_KEEP_CHARS = 2000  # items.json keeps this much of a description (ItemMeta.text uses ~300)


@dataclass(frozen=True)
class PrepareConfig:
    min_rating: float = 4.0
    kcore: int = 5
    split: tuple[int, int, int] = (8, 1, 1)
    seed: int = 2023
    min_train: int = 2


@dataclass
class ReviewScan(PairTimes):
    """What streaming the reviews file left: ``pairs[(user, asin)] = earliest time`` + line counts."""

    lines: int = 0
    malformed: int = 0


# ------------------------------------------------------------------------------------------ reading


def open_text(path: Path) -> IO[str]:
    """Open a plain or gzipped text file (detected by the gzip magic bytes, not the suffix)."""
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    with path.open("rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


def iter_lines(path: Path, desc: str, progress: bool) -> Iterator[str]:
    """Non-blank lines of ``path`` with a progress counter on stderr (``recsvc_base.progress``); a corrupt gzip
    stream is a UserError."""
    from recsvc_base.progress import progress_bar

    with open_text(path) as fh:
        bar = progress_bar(fh, desc=desc, unit=" lines", file=sys.stderr, enabled=progress, mininterval=1.0)
        try:
            for line in bar:
                if line.strip():
                    yield line
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{path}: cannot read (corrupt or truncated gzip?): {exc}") from None
        finally:
            bar.close()


def parse_record(line: str) -> dict[str, Any] | None:
    """One JSON object per line; a Python dict literal (2014 meta) as fallback; None if neither.

    >>> parse_record('{"asin": "B1"}'), parse_record("{'asin': 'B1'}"), parse_record("{oops")
    ({'asin': 'B1'}, {'asin': 'B1'}, None)
    """
    try:
        obj = json.loads(line)
    except ValueError:
        try:
            obj = ast.literal_eval(line.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def parse_review(line: str) -> tuple[str, str, float, int] | None:
    """``(reviewerID, asin, overall, unixReviewTime)`` or None for a malformed line."""
    rec = parse_record(line)
    if rec is None:
        return None
    user, item = rec.get("reviewerID"), rec.get("asin")
    rating, ts = _number(rec.get("overall")), _number(rec.get("unixReviewTime"))
    if not (isinstance(user, str) and user and isinstance(item, str) and item):
        return None
    if rating is None or ts is None:
        return None
    return user, item, rating, int(ts)


def scan_reviews(path: Path, min_rating: float, progress: bool = True) -> ReviewScan:
    """Stream the reviews: rating filter, then dedupe (earliest time per user-item pair wins)."""
    scan = ReviewScan()
    for line in iter_lines(path, f"reviews {path.name}", progress):
        scan.lines += 1
        review = parse_review(line)
        if review is None:
            scan.malformed += 1
            continue
        user, item, rating, ts = review
        if rating < min_rating:
            scan.below_min_rating += 1
            continue
        scan.add(user, item, ts)
    return scan


def _opt_text(value: Any) -> str | None:
    if isinstance(value, list):  # 2018 descriptions are lists of paragraphs
        value = " ".join(str(v) for v in value if isinstance(v, str | int | float))
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        return None
    text = " ".join(html.unescape(str(value)).split())
    return text or None


def _categories(rec: dict[str, Any]) -> tuple[str, ...]:
    """2018 ``category: [str]`` or 2014 ``categories: [[str]]`` -> flat tuple, first occurrence order.

    >>> _categories({"categories": [["Beauty", "Skin"], ["Beauty", "Makeup"]]})
    ('Beauty', 'Skin', 'Makeup')
    """
    raw = rec.get("category", rec.get("categories"))
    flat: list[str] = []
    stack = [raw] if isinstance(raw, str) else list(raw) if isinstance(raw, list) else []
    for entry in stack:
        for name in entry if isinstance(entry, list) else [entry]:
            text = _opt_text(name)
            if text and text not in flat:
                flat.append(text)
    return tuple(flat)


def scan_meta(path: Path, wanted: set[str], progress: bool = True) -> tuple[dict[str, ItemMeta], int, int]:
    """Metadata of the ``wanted`` asins (first line per asin wins) -> (metas, lines, malformed)."""
    metas: dict[str, ItemMeta] = {}
    lines = malformed = 0
    for line in iter_lines(path, f"meta {path.name}", progress):
        lines += 1
        rec = parse_record(line)
        asin = rec.get("asin") if rec is not None else None
        if not (isinstance(asin, str) and asin):
            malformed += 1
            continue
        if asin not in wanted or asin in metas:
            continue
        description = _opt_text(rec.get("description"))
        metas[asin] = ItemMeta(
            asin=asin,
            title=_opt_text(rec.get("title")),
            brand=_opt_text(rec.get("brand")),
            categories=_categories(rec),
            description=description[:DESCRIPTION_KEEP_CHARS] if description else None,
        )
    return metas, lines, malformed


# ------------------------------------------------------------------------------------------ pipeline


def shuffled_ids(keys: list[str], seed: int) -> dict[str, int]:
    """1-based ids for ``keys``: sorted, then shuffled with ``random.Random(seed)`` (stable across runs)."""
    order = sorted(keys)
    random.Random(seed).shuffle(order)
    return {key: idx for idx, key in enumerate(order, start=1)}


def prepare_amazon(
    reviews: str | Path,
    meta: str | Path,
    out: str | Path,
    config: PrepareConfig = PrepareConfig(),
    progress: bool = True,
) -> dict[str, Any]:
    """Run the whole pipeline (module docstring) and return the ``stats.json`` content."""
    reviews, meta, out = Path(reviews), Path(meta), Path(out)
    for path, what in ((reviews, "reviews"), (meta, "meta")):
        if not path.is_file():
            raise UserError(f"{what} file not found: {path}")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out exists and is not a directory: {out}")

    scan = scan_reviews(reviews, config.min_rating, progress)
    if not scan.pairs:
        raise UserError(f"{reviews}: no usable review with rating >= {config.min_rating} "
                        f"({scan.lines} lines, {scan.malformed} malformed)")
    core = kcore(list(scan.pairs), config.kcore)
    if not core:
        raise UserError(f"no interaction survives the {config.kcore}-core filter ({len(scan.pairs)} before)")
    split = split_by_global_time(((scan.pairs[p], p[0], p[1]) for p in core), config.split, config.min_train)
    if not split.train:
        raise UserError(f"no user has >= {config.min_train} train interactions after the split")

    user_ids = {u: idx for idx, u in enumerate(split.users(), start=1)}
    item_ids = shuffled_ids(list(split.items()), config.seed)
    metas, meta_lines, meta_malformed = scan_meta(meta, set(item_ids), progress)
    items = {iid: metas.get(asin, ItemMeta(asin=asin)) for asin, iid in item_ids.items()}
    parts = [
        {user_ids[u]: [item_ids[a] for a in seq] for u, seq in part.items()}
        for part in (split.train, split.valid, split.test)
    ]
    write_split_dir(out, parts[0], parts[1], parts[2], items)

    stats: dict[str, Any] = {
        "users": len(user_ids),
        "items": len(item_ids),
        "interactions": {name: sum(map(len, p.values())) for name, p in zip(SPLITS, parts, strict=True)},
        "users_with_items": {name: sum(1 for s in p.values() if s)
                             for name, p in zip(SPLITS, parts, strict=True)},
        "reviews": {"lines": scan.lines, "malformed": scan.malformed,
                    "below_min_rating": scan.below_min_rating, "duplicates": scan.duplicates,
                    "after_dedupe": len(scan.pairs), "after_kcore": len(core)},
        "dropped_users": split.dropped_users,
        "dropped_interactions": split.dropped_interactions,
        "meta": {"lines": meta_lines, "malformed": meta_malformed, "matched": len(metas),
                 "missing": len(item_ids) - len(metas)},
        "malformed_lines_skipped": scan.malformed + meta_malformed,
        "params": {**asdict(config), "split": list(config.split), "reviews": str(reviews), "meta": str(meta)},
    }
    stats["interactions"]["total"] = sum(stats["interactions"].values())
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    return stats
