"""A bundle's recommender over a live catalog (``recsvc.catalog.file``): added and retired items, no retraining.

:func:`with_catalog` builds, from the recommender loaded from the bundle, one over the bundle's items plus the
added ones; it shares the loaded models (target, drafter network, draft head), the settings (speculation,
beam width, rules), and rebuilds what depends on the catalog:

- the ids, the prompt builder (a history may hold new items) and the trie, on the target's device, with the
  beam search over it; the drafter follows (``Drafter.over``: the transition drafter's prior too); an items
  bundle has no prompts: its item-level target reads the new trie's codes (new items have no per-item table
  row: they read the table's "unseen item" row);
- the fused transition prior, extended with zero counts for the new items (they get only its popularity
  back-off mass: the model has never seen them as targets);
- the popularity fallback order (new items last: nobody has interacted with them);
- the fresh-item component: new items join the fresh set with their text vectors, so they take its tail slots
  for the users whose recent items they resemble;
- the item attributes for rules (the same file over the new trie; new items have no attributes until it lists
  them);
- the item keys: the bundle's (BUNDLE/item_keys.json) plus the additions' ``key`` (one taken by another item is
  a ``UserError``: the file is rejected), served as soon as the state is swapped in;
- the user-state cache: a new one of the same budget, the old one emptied on the swap (conservative: its prompt
  states and decode steps are keyed by tokens and code paths, so they would still hold; a catalog changes rarely).

Retired items stay in the ids (they may still be in users' histories) and are excluded from every response:
:class:`LiveRecommender` adds them to every query's exclusions (dead trie nodes, fresh candidates skipped) and
to the popularity fallback's. It holds the current ``CatalogState`` behind one reference that :meth:`apply`
replaces; a batch reads it once, so a batch in flight finishes on the catalog it started with.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from recsvc.bundle.keys import ItemKeys
from recsvc.bundle.prompt import PromptBuilder
from recsvc.catalog.file import LiveCatalog
from recsvc.content.fresh import FreshItems
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.recommender.answer import Answering
from recsvc.recommender.api import EngineFacts, RecQuery, RecResult
from recsvc.recommender.bundle_recommender import BundleRecommender
from recsvc.recommender.settings import state_cache_for
from recsvc.rules.catalog import RuleCatalog
from recsvc.rules.source import AttributeSource
from recsvc.rules.spec import Rules
from tokenizer_rqvae.trie import CatalogTrie


def fresh_with(fresh: FreshItems, item_ids: np.ndarray, vectors: np.ndarray) -> FreshItems:
    """The fresh component with ``item_ids`` [m] (vectors [m, d]) added to its fresh set."""
    if not len(item_ids):
        return fresh
    return FreshItems(fresh.vectors.with_items(item_ids, vectors),
                      np.concatenate([fresh.fresh_ids, item_ids]), fresh.settings, fresh.counted_on, fresh.query)


def with_catalog(base: BundleRecommender, catalog: LiveCatalog,
                 attributes: AttributeSource | None = None) -> BundleRecommender:
    """A recommender over ``base``'s catalog plus ``catalog``'s additions (``base`` itself when there are
    none; retired items are :class:`LiveRecommender`'s), built by its constructor; ``base`` is not modified.
    ``attributes``: the attribute source to carry over (default: ``base``'s; a served one holds the latest
    reload)."""
    if not len(catalog.item_ids):
        return base
    parts = base.parts
    ids = catalog.merged_ids(parts.ids)
    p = parts.prompts  # None: an items bundle (the timeline reads the new trie's codes; its item table keeps
    #                    the bundle's rows, ``BundleParts.timeline_ids``)
    prompts = PromptBuilder(p.tokenizer, ids, p.max_history, header=p.header) if p is not None else None
    trie = CatalogTrie(ids).to(parts.target.device if parts.target is not None else parts.trie.device)
    source = attributes or parts.attributes
    pairs = catalog.key_pairs()
    keys = (parts.keys or ItemKeys.empty()).with_items(pairs) if pairs else parts.keys
    states = base.states  # a cache of its own (conservative: the old entries, keyed by code paths, would hold)
    over = replace(
        parts, ids=ids, prompts=prompts, trie=trie,
        # the popularity fallback: the bundle's order, then the new items (no interactions), lowest id first
        popular=parts.popular + tuple(catalog.item_ids.tolist()),
        prior=parts.prior.with_items(ids.item_ids) if parts.prior is not None else None,
        drafter=parts.drafter.over(trie) if parts.drafter is not None else None,
        fresh=fresh_with(parts.fresh, catalog.item_ids, catalog.vectors) if parts.fresh is not None else None,
        # the dense head ranks the new items too (they are fresh to the target)
        dense=parts.dense.over(ids, catalog.item_ids, catalog.vectors) if base.dense is not None else None,
        attributes=source.over(trie) if source is not None else None, keys=keys)
    return BundleRecommender(over, replace(
        base.settings, states=(state_cache_for(parts.target, states.budget,
                                               f"{states.version}+catalog-{catalog.version}")
                               if states is not None else None)))


@dataclass(frozen=True)
class CatalogState:
    """What one batch is served with: the recommender and the items it must never return."""

    recommender: BundleRecommender
    catalog: LiveCatalog
    retired: tuple[int, ...]  # ascending

    @property
    def items(self) -> int:
        """Items that can be recommended: the bundle's and the added ones, less the retired."""
        return len(self.recommender.ids) - len(self.retired)


class LiveRecommender(Answering):
    """A ``Recommender`` (``recsvc.recommender.api``) over a bundle's recommender whose catalog :meth:`apply`
    replaces while it serves. It holds the current state (composition): every member of the contract reads the
    current state's recommender, built with its settings (speculation, rules, caches) before it is wrapped."""

    def __init__(self, base: BundleRecommender) -> None:
        self.base = base
        dim = base.fresh.vectors.vectors.shape[1] if base.fresh is not None else 0
        self._state = CatalogState(base, LiveCatalog.empty(base.ids.levels, dim), ())
        self._apply_lock = threading.Lock()
        # the settings no catalog changes (every state's recommender is built from ``base``)
        self.max_k, self.max_history, self.exclude_history = base.max_k, base.max_history, base.exclude_history
        self.facts: EngineFacts = base.facts

    @property
    def state(self) -> CatalogState:
        return self._state

    @property
    def vector_dim(self) -> int | None:
        """The length new items' vectors must have (the fresh component's), None without one."""
        fresh = self.base.fresh
        return int(fresh.vectors.vectors.shape[1]) if fresh is not None else None

    def apply(self, catalog: LiveCatalog) -> CatalogState:
        """Builds the state of ``catalog`` (validated against the bundle: ``recsvc.catalog.file``) and
        makes it current; the previous state serves until then, and batches that read it finish on it."""
        with self._apply_lock:
            previous = self._state.recommender
            if self._state.catalog.same_additions(catalog):  # e.g. only retirements changed: nothing to rebuild
                rec = previous
            else:
                rec = with_catalog(self.base, catalog, previous.attributes)
            state = CatalogState(rec, catalog, tuple(int(i) for i in catalog.retired))
            self._state = state  # one reference: atomic for every reader
            old = previous.states
            if old is not None and old is not rec.states:
                old.clear()  # the swapped-out state's cache: its memory back (a batch still on it just misses)
            return state

    # ---- Recommender --------------------------------------------------------------------------------------
    def recommend(self, queries: Sequence[RecQuery], ledger: Ledger = NO_LEDGER) -> list[RecResult]:
        state = self._state  # read once: the whole batch is decoded over one catalog
        if state.retired:
            queries = [replace(q, exclude=tuple(q.exclude) + state.retired) for q in queries]
        return state.recommender.recommend(queries, ledger)

    @property
    def prefill_ahead_enabled(self) -> bool:
        return self._state.recommender.prefill_ahead_enabled

    def prefill_ahead(self, history: Sequence[int]) -> None:
        self._state.recommender.prefill_ahead(history)

    @property
    def states(self) -> UserStateCache | None:
        """The current state's user-state cache (each catalog state has its own)."""
        return self._state.recommender.states

    def popular_items(self, k: int, exclude: Sequence[int] = (), rules: Rules | None = None) -> list[int]:
        state = self._state
        return state.recommender.popular_items(k, tuple(exclude) + state.retired, rules)

    def known_item(self, item_id: int) -> bool:
        """Retired items stay known: they may be in histories (and excluded), never in responses."""
        return self._state.recommender.known_item(item_id)

    def semantic_id(self, item_id: int) -> list[str]:
        return self._state.recommender.semantic_id(item_id)

    @property
    def has_item_keys(self) -> bool:
        return self._state.recommender.has_item_keys

    def key_of(self, item_id: int) -> str | None:
        """Retired items keep their keys (they may be in histories)."""
        return self._state.recommender.key_of(item_id)

    def item_of_key(self, key: str) -> int | None:
        return self._state.recommender.item_of_key(key)

    @property
    def rule_catalog(self) -> RuleCatalog | None:
        return self._state.recommender.rule_catalog
