"""The live catalog carried over to a new bundle version (recsvc/catalog/carry.py): additions and retirements kept,
additions the new bundle already holds dropped (they are its items now), an addition whose codes the new bundle
gives another item refused with a UserError naming it."""

from __future__ import annotations

import numpy as np
import pytest

from recsvc.catalog.carry import carried_over
from recsvc.catalog.file import parse_catalog
from recsvc.errors import UserError
from tokenizer_rqvae.ids import SemanticIds


def ids_of(rows: dict[int, tuple[int, int, int, int]]) -> SemanticIds:
    items = sorted(rows)
    return SemanticIds(np.array(items, dtype=np.int64), np.array([rows[i] for i in items], dtype=np.int64), 256)


OLD = ids_of({1: (0, 0, 0, 1), 2: (0, 0, 0, 2), 3: (0, 0, 0, 3)})
DOC = {"version": 4, "add": [{"item_id": 10, "codes": [0, 0, 1, 0], "vector": [1.0, 0.0]},
                             {"item_id": 11, "codes": [0, 0, 1, 1], "vector": [0.0, 1.0]}],
       "retire": [2, 11]}


def test_a_catalog_carries_over_to_a_retrained_bundle() -> None:
    catalog = parse_catalog(DOC, OLD, 2)
    same_items = ids_of({1: (5, 0, 0, 1), 2: (5, 0, 0, 2), 3: (5, 0, 0, 3)})  # new ids, the same items
    carried, dropped = carried_over(catalog, same_items, 2)
    assert carried.version == 4 and carried.item_ids.tolist() == [10, 11] and carried.retired.tolist() == [2, 11]
    assert dropped == {"added_now_in_bundle": 0, "retired_not_in_bundle": 0}
    # a bundle retrained on ids that include item 10 (`recsvc catalog ids`), without item 2 any more
    grown = ids_of({1: (0, 0, 0, 1), 3: (0, 0, 0, 3), 10: (0, 0, 1, 0)})
    carried, dropped = carried_over(catalog, grown, 2)
    assert carried.item_ids.tolist() == [11] and carried.retired.tolist() == [11]
    assert dropped == {"added_now_in_bundle": 1, "retired_not_in_bundle": 1}


def test_an_addition_whose_codes_the_new_bundle_gives_another_item_is_refused() -> None:
    catalog = parse_catalog(DOC, OLD, 2)
    clash = ids_of({1: (0, 0, 0, 1), 2: (0, 0, 0, 2), 3: (0, 0, 1, 1)})  # item 11's codes are item 3's now
    with pytest.raises(UserError, match=r"add\[1\]\.codes: \[0, 0, 1, 1\] is already item 3's id"):
        carried_over(catalog, clash, 2)
