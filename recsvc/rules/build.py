"""items.json (``recsvc data prepare-amazon``, the shared splits) -> item attributes for rules.

Which fields become attributes:
- ``brand`` (a string) and ``categories`` (a list: every category of the item) as they are;
- ``price`` (a number, or text like "$12.99") -> ``price_band``: "0-10", "10-25", ..., "100+" (``--price-bands``);
- any other field holding a string, number, boolean or list of strings (e.g. ``in_stock``), as it is;
- never ``asin``, ``title``, ``description`` (identifiers and free text).
With ``from_title``: ``brand`` from the title's first word where the item has none, and ``category`` from the
title's words (``recsvc.rules.derive``).

    >>> a = build_attributes({1: {"title": "Olay Night Cream", "price": "$19.99"}}, from_title=True)
    >>> a.values["brand"][1], a.values["category"][1], a.values["price_band"][1]
    (('olay',), ('skin',), ('10-25',))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from recsvc.rules.attributes import ItemAttributes, read_json_file
from recsvc.rules.derive import title_brand, title_category

SKIPPED = frozenset({"asin", "title", "description"})
DEFAULT_PRICE_BANDS = (10.0, 25.0, 50.0, 100.0)
_PRICE = re.compile(r"[-+]?\d+(?:\.\d+)?")


def price_band(price: Any, edges: Sequence[float] = DEFAULT_PRICE_BANDS) -> str | None:
    """``price_band("$12.99") == "10-25"``, ``price_band(120) == "100+"``, ``price_band("n/a") is None``."""
    if isinstance(price, bool):
        return None
    if isinstance(price, int | float):
        value = float(price)
    else:
        match = _PRICE.search(str(price).replace(",", ""))
        if match is None:
            return None
        value = float(match.group())
    lo = 0.0
    for edge in edges:
        if value < edge:
            return f"{_num(lo)}-{_num(edge)}"
        lo = edge
    return f"{_num(lo)}+"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def build_attributes(items: Mapping[int, Mapping[str, Any]], from_title: bool = False,
                     price_bands: Sequence[float] = DEFAULT_PRICE_BANDS) -> ItemAttributes:
    """{item id: items.json entry} -> ItemAttributes (see the module docstring)."""
    out: dict[int, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for item, meta in items.items():
        attrs: dict[str, Any] = {}
        for name, value in meta.items():
            if name in SKIPPED or value is None:
                continue
            if name == "price":
                band = price_band(value, price_bands)
                if band is not None:
                    attrs["price_band"] = band
                    sources["price_band"] = f"items.json price, bands {list(price_bands)}"
                continue
            if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, dict | list) for v in value)):
                continue  # nested structures are not attribute values
            attrs[name] = value
            sources.setdefault(name, f"items.json {name}")
        if from_title:
            if not attrs.get("brand"):
                brand = title_brand(meta.get("title"))
                if brand:
                    attrs["brand"] = brand
                    sources["brand"] = "items.json brand, else the title's first word"
            category = title_category(meta.get("title"))
            if category:
                attrs["category"] = category
                sources["category"] = "title keywords (recsvc.rules.derive.TITLE_CATEGORIES)"
        out[int(item)] = attrs
    return ItemAttributes.from_items(out, sources)


def read_items_json(path: str | Path) -> dict[int, Mapping[str, Any]]:
    """``{"<item_id>": {...}}`` -> {item id: entry}; UserError for anything else."""
    path = Path(path)
    raw = read_json_file(path, f"no items file at {path}")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected an object {{item_id: {{...}}}}")
    out: dict[int, Mapping[str, Any]] = {}
    for key, meta in raw.items():
        try:
            item = int(key)
        except ValueError:
            raise UserError(f"{path}: item key {key!r} is not an integer item id") from None
        out[item] = meta if isinstance(meta, dict) else {}
    return out
