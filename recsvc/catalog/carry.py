"""The live catalog carried over to a new bundle version (``recsvc serve`` swapping bundles,
``recsvc.service.swap.bundle_watch``): the items added and retired at run time stay added and retired.

The additions the new bundle already holds (a bundle retrained on ids that include them: ``recsvc catalog ids``
then ``recsvc build --ids``) are its own items now and are dropped from the carried catalog, as are retirements
of items the new bundle no longer has; the rest is validated against the new bundle's ids like a file
(``parse_catalog``): an addition whose codes are another item's id in the new bundle is a ``UserError`` naming it,
and the swap is refused.
"""

from __future__ import annotations

from recsvc.catalog.file import LiveCatalog, parse_catalog
from tokenizer_rqvae.ids import SemanticIds


def carried_over(catalog: LiveCatalog, ids: SemanticIds, vector_dim: int | None) -> tuple[LiveCatalog, dict[str, int]]:
    """(``catalog`` validated against the new bundle's ``ids``, what was dropped: {"added_now_in_bundle": n,
    "retired_not_in_bundle": n}). UserError when an addition cannot be carried (its codes are taken)."""
    doc = catalog.to_json()
    adds = [a for a in doc["add"] if a["item_id"] not in ids]
    added = {a["item_id"] for a in adds}
    retire = [i for i in doc["retire"] if i in ids or i in added]
    dropped = {"added_now_in_bundle": len(doc["add"]) - len(adds),
               "retired_not_in_bundle": len(doc["retire"]) - len(retire)}
    return parse_catalog({"version": doc["version"], "add": adds, "retire": retire}, ids, vector_dim), dropped
