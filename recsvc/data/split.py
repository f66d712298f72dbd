"""Loader (and writer) for the split data format described in ``docs/ARCHITECTURE.md``.

A data directory holds ``sequential_{train,valid,test}.txt`` (one line per user: ``user_id item_id ...``,
chronological; a line with only the user id means no items in that period) and ``items.json``
(``{"<item_id>": {"asin": ..., "title": ... or null, "brand", "categories", "description"}}``).

Evaluation protocol (the paper's): valid -> history = train items, targets = valid items; test -> history =
train + valid items, targets = all test items. Only users with at least one target are evaluated.

Example::

    >>> data = load_split_dir("data/beauty")      # doctest: +SKIP
    >>> u = data.eval_users("test")[0]                                 # doctest: +SKIP
    >>> u.history == data.train[u.user_id] + data.valid[u.user_id]     # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsvc.errors import UserError

SPLITS = ("train", "valid", "test")
EVAL_SPLITS = ("valid", "test")
ITEMS_FILE = "items.json"
DESCRIPTION_CHARS = 300


def split_file(split: str) -> str:
    """File name of one split: ``split_file("valid") == "sequential_valid.txt"``."""
    return f"sequential_{split}.txt"


@dataclass(frozen=True)
class ItemMeta:
    """Catalog metadata of one item; every field is optional."""

    asin: str | None = None
    title: str | None = None
    brand: str | None = None
    categories: tuple[str, ...] = ()
    description: str | None = None

    def text(self) -> str:
        """Text for the sentence embedder: only the fields that are present, description cut to ~300 chars.

        >>> ItemMeta(asin="B1", title="Rose Soap", categories=("Beauty", "Bath")).text()
        'Title: Rose Soap; Categories: Beauty, Bath'
        >>> ItemMeta(asin="B1").text(), ItemMeta().text()
        ('item B1', 'unknown item')
        """
        parts: list[str] = []
        if self.title:
            parts.append(f"Title: {_squash(self.title)}")
        if self.brand:
            parts.append(f"Brand: {_squash(self.brand)}")
        if self.categories:
            parts.append("Categories: " + ", ".join(_squash(c) for c in self.categories))
        if self.description:
            parts.append(f"Description: {_truncate(_squash(self.description), DESCRIPTION_CHARS)}")
        if parts:
            return "; ".join(parts)
        return f"item {self.asin}" if self.asin else "unknown item"

    def to_json(self) -> dict[str, Any]:
        """The ``items.json`` entry for this item (all keys written; absent values as null / [])."""
        return {
            "asin": self.asin,
            "title": self.title,
            "brand": self.brand,
            "categories": list(self.categories),
            "description": self.description,
        }


@dataclass(frozen=True)
class EvalUser:
    user_id: int
    history: list[int]  # chronological items before the period
    targets: list[int]  # items of the evaluated period (>= 1)


@dataclass
class SplitData:
    root: Path
    train: dict[int, list[int]]  # user_id -> chronological item ids (every user)
    valid: dict[int, list[int]]  # user_id -> items of the valid period (may be an empty list)
    test: dict[int, list[int]]
    items: dict[int, ItemMeta] = field(default_factory=dict)

    def eval_users(self, split: str) -> list[EvalUser]:
        """Users with >= 1 target in ``split`` ("valid" or "test"), sorted by user id.

        "valid": history = train, targets = valid. "test": history = train + valid, targets = test.
        """
        _check_eval_split(split)
        out: list[EvalUser] = []
        for user in sorted(self.train):
            targets = self.valid.get(user, []) if split == "valid" else self.test.get(user, [])
            if not targets:
                continue
            history = list(self.train[user])
            if split == "test":
                history += self.valid.get(user, [])
            out.append(EvalUser(user_id=user, history=history, targets=list(targets)))
        return out

    def item_popularity(self, split: str) -> dict[int, int]:
        """Interaction counts over the items a model may see before ``split``.

        "valid": counts over train; "test": over train + valid. Items never seen have no key (``.get(i, 0)``).
        """
        _check_eval_split(split)
        counts: Counter[int] = Counter()
        for seq in self.train.values():
            counts.update(seq)
        if split == "test":
            for seq in self.valid.values():
                counts.update(seq)
        return dict(counts)

    def sequences(self, periods: str) -> dict[int, list[int]]:
        """user_id -> chronological items of ``periods``: "train", or "train+valid" (train followed by valid):
        what a model fitted before the valid / the test period may learn from."""
        if periods == "train":
            return {u: list(s) for u, s in self.train.items()}
        if periods == "train+valid":
            return {u: list(s) + list(self.valid.get(u, [])) for u, s in self.train.items()}
        raise UserError(f"unknown periods {periods!r}: expected train or train+valid")

    @property
    def num_items(self) -> int:
        """Number of catalog items (entries of ``items.json``; ids are 1..num_items in written data)."""
        return len(self.items)

    @property
    def num_users(self) -> int:
        return len(self.train)


def _check_eval_split(split: str) -> None:
    if split not in EVAL_SPLITS:
        raise UserError(f"unknown split {split!r}: expected one of {', '.join(EVAL_SPLITS)}")


def _squash(text: str) -> str:
    return " ".join(str(text).split())


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0] if " " in text[:limit] else text[:limit]
    return cut.rstrip(" ,;.") + "..."


# ----------------------------------------------------------------------------------------------- loading


def load_split_dir(path: str | Path) -> SplitData:
    """Load a data directory; any format problem is a :class:`UserError` naming the file and line."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"data directory not found: {root}")
    items = load_items(root / ITEMS_FILE)
    seqs = {split: _read_sequences(root / split_file(split), items) for split in SPLITS}
    train = seqs["train"]
    for split in EVAL_SPLITS:
        for user in seqs[split]:
            if user not in train:
                raise UserError(f"{split_file(split)}: user {user} has no line in {split_file('train')}")
    valid = {user: seqs["valid"].get(user, []) for user in train}
    test = {user: seqs["test"].get(user, []) for user in train}
    return SplitData(root=root, train=train, valid=valid, test=test, items=items)


def _read_sequences(path: Path, items: dict[int, ItemMeta]) -> dict[int, list[int]]:
    if not path.is_file():
        raise UserError(f"missing file: {path} (a data directory needs {', '.join(map(split_file, SPLITS))} "
                        f"and {ITEMS_FILE})")
    out: dict[int, list[int]] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            tokens = line.split()
            if not tokens:
                continue
            try:
                ids = [int(tok) for tok in tokens]
            except ValueError:
                bad = next(tok for tok in tokens if not _is_int(tok))
                raise UserError(f"{path.name} line {lineno}: not an integer: {bad!r}") from None
            user, seq = ids[0], ids[1:]
            if user < 1:
                raise UserError(f"{path.name} line {lineno}: user id must be >= 1, got {user}")
            if user in out:
                raise UserError(f"{path.name} line {lineno}: user {user} appears twice")
            for item in seq:
                if item not in items:
                    raise UserError(f"{path.name} line {lineno}: item {item} is not in {ITEMS_FILE}")
            out[user] = seq
    return out


def _is_int(token: str) -> bool:
    try:
        int(token)
    except ValueError:
        return False
    return True


def load_items(path: Path) -> dict[int, ItemMeta]:
    """Parse ``items.json`` into ``{item_id: ItemMeta}``."""
    if not path.is_file():
        raise UserError(f"missing file: {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        where = f"{path.name} line {exc.lineno} column {exc.colno}"
        raise UserError(f"{where}: invalid JSON: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path.name}: not UTF-8 text ({exc.reason})") from None
    if not isinstance(raw, dict):
        raise UserError(f'{path.name}: expected a JSON object {{"<item_id>": {{...}}}}, '
                        f"got {type(raw).__name__}")
    items: dict[int, ItemMeta] = {}
    for key, value in raw.items():
        try:
            item_id = int(key)
        except ValueError:
            raise UserError(f"{path.name}: item key {key!r} is not an integer id") from None
        if item_id < 1:
            raise UserError(f"{path.name}: item id must be >= 1, got {item_id}")
        if not isinstance(value, dict):
            raise UserError(f"{path.name}: item {key}: expected an object, got {type(value).__name__}")
        items[item_id] = _item_from_json(value, f"{path.name}: item {key}")
    return items


def _item_from_json(value: dict[str, Any], where: str) -> ItemMeta:
    def opt_str(name: str) -> str | None:
        v = value.get(name)
        if v is None or v == "":
            return None
        if isinstance(v, list):  # e.g. a raw description list
            v = " ".join(str(x) for x in v if x)
            return v or None
        if not isinstance(v, str | int | float):
            raise UserError(f"{where}: field {name!r} must be a string, got {type(v).__name__}")
        return str(v)

    cats = value.get("categories") or []
    if isinstance(cats, str):
        cats = [cats]
    if isinstance(cats, list) and all(isinstance(c, list) for c in cats):  # Amazon's [["a", "b"], ["a", "c"]]
        cats = list(dict.fromkeys(c for path in cats for c in path))
    if not isinstance(cats, list) or not all(isinstance(c, str) for c in cats):
        raise UserError(f"{where}: field 'categories' must be a list of strings (or of lists of strings)")
    return ItemMeta(
        asin=opt_str("asin"),
        title=opt_str("title"),
        brand=opt_str("brand"),
        categories=tuple(cats),
        description=opt_str("description"),
    )


# ----------------------------------------------------------------------------------------------- writing


def write_split_dir(
    out: str | Path,
    train: dict[int, list[int]],
    valid: dict[int, list[int]],
    test: dict[int, list[int]],
    items: dict[int, ItemMeta],
) -> Path:
    """Write the format: a line per user of ``train`` in each split file (ascending ids) + items.json."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    users = sorted(train)
    for split, seqs in (("train", train), ("valid", valid), ("test", test)):
        lines = (" ".join(map(str, [user, *seqs.get(user, [])])) for user in users)
        (root / split_file(split)).write_text("\n".join(lines) + "\n", encoding="utf-8")
    payload = {str(i): items[i].to_json() for i in sorted(items)}
    (root / ITEMS_FILE).write_text(json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n",
                                   encoding="utf-8")
    return root


def split_stats(data: SplitData) -> dict[str, Any]:
    """Counts for ``recsvc data stats``: users, items, interactions and users-with-items per split."""

    def count(seqs: Iterable[list[int]]) -> int:
        return sum(len(s) for s in seqs)

    seen_train = {i for s in data.train.values() for i in s}
    return {
        "root": str(data.root),
        "users": data.num_users,
        "items": data.num_items,
        "interactions": {
            "train": count(data.train.values()),
            "valid": count(data.valid.values()),
            "test": count(data.test.values()),
        },
        "users_with_items": {
            "train": sum(1 for s in data.train.values() if s),
            "valid": sum(1 for s in data.valid.values() if s),
            "test": sum(1 for s in data.test.values() if s),
        },
        "items_in_train": len(seen_train),
        "items_without_title": sum(1 for m in data.items.values() if not m.title),
    }
