"""The item table of ``recsvc data import``: one row per item (id, title; optional description, brand, categories).

Columns are named by ``--item-columns id=...,title=...,description=...,brand=...,categories=...`` (defaults
``item_id``, ``title``, ``description``, ``brand``, ``categories``). id and title must exist (an empty title is
allowed: the item's text is then its other fields); an optional field is read when its column is present, and a
column named on the command line must exist. Categories: a Parquet list of strings, or text split on
``--category-sep`` (default ``|``): ``Beauty|Hair Care|Shampoo``.
"""

from __future__ import annotations

from typing import Any

from recsvc.data.split import ItemMeta
from recsvc.errors import UserError
from training.data.amazon_raw import DESCRIPTION_KEEP_CHARS
from training.data.columns import Columns
from training.data.import_log import cell_text
from training.data.tabular import Table

ITEM_COLUMNS = Columns("--item-columns", {"id": "item_id", "title": "title", "description": "description",
                                          "brand": "brand", "categories": "categories"}, labels={"id": "item id"})
OPTIONAL_ROLES = ("description", "brand", "categories")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, list):
        value = " ".join(str(v) for v in value if v is not None)
    text = " ".join(str(value).split())
    return text or None


def _categories(value: Any, sep: str) -> tuple[str, ...]:
    """``"Beauty|Hair Care"`` or ``["Beauty", "Hair Care"]`` -> a tuple without blanks or repeats."""
    if value is None:
        return ()
    raw = [str(v) for v in value if v is not None] if isinstance(value, list | tuple) else str(value).split(sep)
    out: list[str] = []
    for name in raw:
        name = " ".join(name.split())
        if name and name not in out:
            out.append(name)
    return tuple(out)


def read_items(table: Table, cols: Columns, category_sep: str = "|") -> dict[str, ItemMeta]:
    """``{external item id: ItemMeta}`` (``asin`` = the external id; ``cols``: :data:`ITEM_COLUMNS` as given);
    a duplicate or empty id is a UserError naming both rows."""
    present = cols.require(table, "id", "title", optional=OPTIONAL_ROLES)
    names = [cols["id"], cols["title"]] + [cols[role] for role in present]
    items: dict[str, ItemMeta] = {}
    first_row: dict[str, int] = {}
    for row, values in table.rows(names):
        item = cell_text(values[0])
        if not item:
            raise UserError(f"{table.where(row)}, column {cols['id']!r}: empty item id")
        if item in first_row:
            raise UserError(f"{table.where(row)}, column {cols['id']!r}: duplicate item id {item!r} "
                            f"(first at row {first_row[item]})")
        first_row[item] = row
        fields = dict(zip(present, values[2:], strict=True))
        description = _text(fields.get("description"))
        items[item] = ItemMeta(
            asin=item,
            title=_text(values[1]),
            brand=_text(fields.get("brand")),
            categories=_categories(fields.get("categories"), category_sep),
            description=description[:DESCRIPTION_KEEP_CHARS] if description else None,
        )
    if not items:
        raise UserError(f"{table.path}: no item rows")
    return items
