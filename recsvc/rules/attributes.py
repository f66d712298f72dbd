"""Item attributes for list-level rules: the file BUNDLE/attributes.json and its in-memory form.

File (written by ``recsvc bundle attributes``, ``recsvc.rules.build``; may be written by any other job, e.g. an
hourly stock export, and is re-read while serving when it changes)::

    {"version": 1,
     "attributes": {"brand": {"source": "items.json brand, else the title's first word"}, "category": {...}},
     "items": {"17": {"brand": "olay", "category": "skin"},
               "18": {"brand": "opi", "categories": ["beauty", "nail polish"], "in_stock": "yes"}}}

An item's value is a string or a list of strings (several values: the item has each of them); values are
normalised on load (``spec.normalize_value``). Items not listed simply have no value.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from recsvc.rules.spec import normalize_value

VERSION = 1
FILE_NAME = "attributes.json"


def read_json_file(path: Path, missing: str) -> Any:
    """The JSON document at ``path``; UserError ``missing`` when there is no file, or one naming the JSON error."""
    if not path.is_file():
        raise UserError(missing)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from exc


@dataclass(frozen=True)
class ItemAttributes:
    values: Mapping[str, Mapping[int, tuple[str, ...]]]  # attribute -> item id -> its normalised values
    sources: Mapping[str, str]  # attribute -> how it was made (for humans)

    @property
    def names(self) -> list[str]:
        return sorted(self.values)

    def vocabulary(self, attribute: str) -> list[str]:
        """Every value of ``attribute`` that some item has, sorted."""
        return sorted({v for vals in self.values[attribute].values() for v in vals})

    @classmethod
    def from_items(cls, items: Mapping[int, Mapping[str, Any]], sources: Mapping[str, str] | None = None,
                   where: str = "attributes") -> ItemAttributes:
        """{item id: {attribute: value or [values]}} -> ItemAttributes (UserError on a malformed entry)."""
        values: dict[str, dict[int, tuple[str, ...]]] = {}
        for item, attrs in items.items():
            if not isinstance(attrs, Mapping):
                raise UserError(f"{where}: item {item}: expected an object of attribute values")
            for name, raw in attrs.items():
                norm = _values(raw, f"{where}: item {item}, attribute {name!r}")
                if norm:
                    values.setdefault(str(name), {})[int(item)] = norm
        srcs = dict(sources or {})
        for name in values:
            srcs.setdefault(name, "")
        return cls(values, {n: srcs[n] for n in values})

    def to_json(self) -> dict[str, Any]:
        items: dict[str, dict[str, Any]] = {}
        for name in self.names:
            for item, vals in self.values[name].items():
                items.setdefault(str(item), {})[name] = vals[0] if len(vals) == 1 else list(vals)
        ordered = dict(sorted(items.items(), key=lambda kv: int(kv[0])))
        return {"version": VERSION, "attributes": {n: {"source": self.sources.get(n, "")} for n in self.names},
                "items": ordered}

    def save(self, path: str | Path) -> None:
        """Atomic write (temp file + rename): a server re-reading the file never sees half of it."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        doc = self.to_json()
        items = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in doc["items"].items()]
        head = json.dumps({"version": doc["version"], "attributes": doc["attributes"]}, ensure_ascii=False)[:-1]
        tmp.write_text(head + ', "items": {\n' + ",\n".join(items) + "\n}}\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> ItemAttributes:
        path = Path(path)
        raw = read_json_file(path, f"no item attributes at {path}: run `recsvc bundle attributes --bundle BUNDLE`")
        if not isinstance(raw, dict) or raw.get("version") != VERSION or not isinstance(raw.get("items"), dict):
            raise UserError(f"{path}: expected {{\"version\": {VERSION}, \"items\": {{...}}}}")
        items: dict[int, Mapping[str, Any]] = {}
        for key, attrs in raw["items"].items():
            try:
                items[int(key)] = attrs
            except ValueError:
                raise UserError(f"{path}: item key {key!r} is not an integer item id") from None
        meta = raw.get("attributes") or {}
        sources = {str(n): str((m or {}).get("source", "")) for n, m in meta.items() if isinstance(m, dict)}
        return cls.from_items(items, sources, where=str(path))


def _values(raw: Any, where: str) -> tuple[str, ...]:
    """A value or a list of values -> normalised, deduplicated, first-seen order; None / "" / [] -> ()."""
    seq = raw if isinstance(raw, list) else [raw]
    out: list[str] = []
    for v in seq:
        if v is None:
            continue
        if isinstance(v, bool):
            v = "yes" if v else "no"
        if not isinstance(v, str | int | float):
            raise UserError(f"{where}: values must be strings (or lists of strings), got {type(v).__name__}")
        text = normalize_value(str(v))
        if text and text not in out:
            out.append(text)
    return tuple(out)
