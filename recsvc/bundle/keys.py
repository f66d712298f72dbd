"""The catalog's item keys: each item's own id in the team's systems (the ``asin`` of the split's items.json),
beside the number the split gave it (``recsvc data import`` renumbers items 1..N).

::

    BUNDLE/item_keys.json   {"<item_id>": "<key>", ...}: one key per item that has one; keys are unique

``write_serving_files`` (``recsvc build``, ``recsvc bundle serving-files``) writes it from the split; the
recommender loads it with the bundle's parts (``read_item_keys``) and the service translates keys on the wire
to numbers and back. A bundle without the file has no keys (requests with keys are refused). Items added to the
live catalog may carry a key (``recsvc.catalog.file``): :meth:`ItemKeys.with_items` lays them over the bundle's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from recsvc.errors import UserError

if TYPE_CHECKING:
    from recsvc.data.split import ItemMeta

KEYS_FILE = "item_keys.json"


@dataclass(frozen=True)
class ItemKeys:
    """Item number <-> key, both ways (read-only once built: shared by every request thread)."""

    by_item: Mapping[int, str]
    by_key: Mapping[str, int]

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, str]]) -> ItemKeys:
        """The table of ``(item, key)`` pairs; UserError when a key is empty, an item has two keys or two items
        share a key."""
        by_item: dict[int, str] = {}
        by_key: dict[str, int] = {}
        for item, key in pairs:
            if not isinstance(key, str) or not key:
                raise UserError(f"item {item}: its key must be a non-empty string, got {key!r}")
            if item in by_item:
                raise UserError(f"item {item} has two keys: {by_item[item]!r} and {key!r}")
            if key in by_key:
                raise UserError(f"key {key!r} is both item {by_key[key]}'s and item {item}'s")
            by_item[int(item)] = key
            by_key[key] = int(item)
        return cls(by_item, by_key)

    @classmethod
    def empty(cls) -> ItemKeys:
        return cls({}, {})

    def __len__(self) -> int:
        return len(self.by_item)

    def key_of(self, item_id: int) -> str | None:
        """The item's key; None when it has none."""
        return self.by_item.get(item_id)

    def item_of(self, key: str) -> int | None:
        """The key's item; None for a key of no item."""
        return self.by_key.get(key)

    def with_items(self, pairs: Iterable[tuple[int, str]]) -> ItemKeys:
        """This table plus ``pairs`` (items added to the live catalog); UserError when an added key is taken."""
        pairs = list(pairs)
        if not pairs:
            return self
        return ItemKeys.from_pairs([*self.by_item.items(), *pairs])


def keys_of_items(items: Mapping[int, ItemMeta]) -> tuple[dict[int, str], list[str]]:
    """(item -> key, the keys left out) of a split's items: each item's ``asin`` when it has one; a key that two
    items share names neither, and is returned among those left out."""
    owners: dict[str, list[int]] = {}
    for item, meta in items.items():
        if meta.asin:
            owners.setdefault(meta.asin, []).append(int(item))
    keys = {found[0]: key for key, found in owners.items() if len(found) == 1}
    return dict(sorted(keys.items())), sorted(key for key, found in owners.items() if len(found) > 1)


def write_item_keys(bundle_root: str | Path, keys: Mapping[int, str]) -> Path:
    """BUNDLE/item_keys.json (atomically, readable by the serving user)."""
    path = Path(bundle_root) / KEYS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({str(i): k for i, k in sorted(keys.items())}, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def read_item_keys(bundle_root: str | Path) -> ItemKeys | None:
    """BUNDLE/item_keys.json; None when the bundle has none; UserError when it is malformed."""
    path = Path(bundle_root) / KEYS_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected {{\"<item_id>\": \"<key>\"}}")
    try:
        pairs = [(int(item), key) for item, key in doc.items()]
    except ValueError as exc:
        raise UserError(f"{path}: item ids must be integers ({exc})") from exc
    try:
        return ItemKeys.from_pairs(pairs)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
