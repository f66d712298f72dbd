"""What every stage of one recommender reads: its parts and settings, and the per-batch views built from them
(each query's exclusions, the rules' catalog as it is now, the fused prior of a batch's histories)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recsvc.engine.entry.dispatch import Mode
from recsvc.engine.scoring.exclusion import SparseDead
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.errors import UserError
from recsvc.recommender.api import RecQuery
from recsvc.recommender.parts import BundleParts
from recsvc.recommender.settings import RecommenderSettings
from recsvc.rules.catalog import BatchRules, RuleCatalog
from recsvc.rules.spec import Rules


@dataclass(frozen=True)
class Scope:
    parts: BundleParts
    settings: RecommenderSettings

    @property
    def prior_weight(self) -> float:
        prior = self.parts.prior
        return float(prior.settings.weight) if prior is not None else 0.0

    def width_for(self, k: int, mode: Mode) -> int:
        """Beams searched for a request of k items: max(k, B) for plain / strict (deterministic top-k), k for
        relaxed (a sample has no ranking to keep consistent)."""
        return max(k, self.settings.beam_width) if mode in ("plain", "strict") else k

    def no_speculation(self, width: int) -> str:
        """Why strict speculation does not run at this beam width ("" when it does)."""
        return "no drafter" if self.parts.drafter is None else self.settings.spec.plain_reason(width)

    def excludes_history(self, query: RecQuery) -> bool:
        """Whether ``query``'s history items are left out: the query's own choice, else the recommender's."""
        return self.settings.exclude_history if query.exclude_history is None else query.exclude_history

    def excluded(self, queries: Sequence[RecQuery]) -> list[list[int]]:
        """[B] each query's excluded items: its own, and its history when it is left out."""
        return [list(q.exclude) + (list(q.history) if self.excludes_history(q) else []) for q in queries]

    def rule_catalog(self) -> RuleCatalog | None:
        """The item attributes laid over the trie, as the attributes file is now (None: no attributes)."""
        source = self.parts.attributes
        return source.current() if source is not None else None

    def catalog(self) -> RuleCatalog:
        """The rules' catalog, read once per batch (a refresh swaps it between batches); UserError without one."""
        catalog = self.rule_catalog()
        if catalog is None:
            raise UserError("rules need item attributes: this server has none (`recsvc bundle attributes`)")
        return catalog

    @staticmethod
    def compiled(catalog: RuleCatalog, queries: Sequence[RecQuery], excluded: list[list[int]]) -> BatchRules:
        return catalog.compile([(q.rules or Rules()).effective(q.k) for q in queries], excluded)

    def dead(self, excluded: list[list[int]]) -> torch.Tensor | None:
        """[B, num_nodes] the excluded items as dead trie nodes (None: nothing excluded)."""
        return self.parts.trie.dead_nodes(excluded) if any(excluded) else None

    def sparse_dead(self, excluded: list[list[int]]) -> SparseDead | None:
        """``dead``'s nodes, sparse ([B, D] dead nodes' parents and codes; None: nothing excluded in the trie)."""
        return SparseDead.of(self.parts.trie, excluded) if any(excluded) else None

    def prior_for(self, histories: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """[B, num_nodes] the fused prior of these histories (``prior_log_mass``), None when there is none."""
        prior, trie, weight = self.parts.prior, self.parts.trie, self.prior_weight
        if prior is None or weight <= 0:
            return None
        states = self.settings.states
        if states is None or len(histories) != 1:  # batches: computed together, never kept (rounding may differ)
            return prior_log_mass(trie, prior.probs(histories), weight)  # on the trie's device
        # one history with a user-state cache on: a returning user's row is kept (the very tensor computed for
        # it alone, so cached == computed, bit for bit); keyed by the prior and trie objects themselves (a swap
        # of either, e.g. a live catalog's new trie, misses)
        key = ("prior", prior, trie, weight, tuple(histories[0]))
        row = states.prior(key)
        if row is None:
            row = prior_log_mass(trie, prior.probs(histories), weight)[0]
            states.keep_prior(key, row)
        return row[None]
