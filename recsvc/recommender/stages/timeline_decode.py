"""A batch decoded by the item-level target (``recsvc.timeline``): the timeline once per request (its state kept in
the user-state cache), then the code decoder's trie-constrained beam search (``recsvc.timeline.search``), one
search per group of (beam width, rules).

As the token target's decoding: exclusions and the rules' filters are dead trie nodes, the fused prior
(``Scope.prior_for``) is added step by step, each query reads the first k of a search of ``width_for(k)`` beams,
fresh items' tails follow as a list stage. What differs:
- the item-level target has no drafter and does not sample: strict and relaxed queries are decoded plainly, the
  decoding's ``fallback`` says why;
- caps and boosts: a search of at least ``RULES_WIDTH`` x k beams under the filters, each leaf's boost added to
  its score, re-sorted, then the caps' greedy pick of k over that order (the rules' postfilter over a wide
  search; ``RuleSettings.strategy`` does not apply);
- with a user-state cache, a query without rules keeps its search output (leaves and scores) under everything
  it depends on (the model, the trie, the prior and its weight, the history, the width, the exclusions): an
  identical request returns it with no forward at all; the timeline state is kept under the items it reads.

``RecStats.target_calls`` (and ``rounds``) counts the decoder's L calls plus the timeline's one (0 when its state
was cached; 0 in all for a kept search output).

Shapes: B queries, W beams, H hidden.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from recsvc.engine.entry.modes import Decoding
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.scoring.exclusion import SparseDead
from recsvc.recommender.api import RecQuery, RecResult, RecStats
from recsvc.recommender.stages.scope import Scope
from recsvc.rules.catalog import BatchRules
from recsvc.rules.greedy import greedy_pick
from recsvc.timeline.model import TimelineModel
from recsvc.timeline.search import TimelineOutput, beam_search, kept_items, user_states

RULES_WIDTH = 4  # caps and boosts: beams searched per item of the list (at least)
NO_DRAFTER = "the item-level target has no drafter"  # why it never speculates (also the serving log's reason)
WHY_PLAIN = {"strict": f"{NO_DRAFTER}: plain beam search",
             "relaxed": "the item-level target does not sample: plain beam search"}
Kept = tuple[torch.Tensor, torch.Tensor]  # a query's search output: leaves [W], scores [W] (float32)


class TimelineDecode:
    def __init__(self, scope: Scope, model: TimelineModel) -> None:
        self.scope, self.model = scope, model

    def __call__(self, queries: Sequence[RecQuery], ledger: Ledger = NO_LEDGER) -> list[RecResult]:
        """Each query's list, in the queries' order: one search per (width, rules or not) group."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, q in enumerate(queries):
            groups.setdefault((self.width_of(q), q.rules is not None), []).append(i)
        results: list[RecResult | None] = [None] * len(queries)
        for (width, ruled), idx in groups.items():
            batch = [queries[i] for i in idx]
            out = self._ruled(batch, width) if ruled else self._plain(batch, width)
            for i, res in zip(idx, out, strict=True):
                results[i] = res
        return [r for r in results if r is not None]

    def width_of(self, query: RecQuery) -> int:
        """Beams searched for ``query``: the plain width (max(k, B)), at least RULES_WIDTH x k with caps or
        boosts that can change its list."""
        width = self.scope.width_for(query.k, "plain")
        if query.rules is not None and query.rules.effective(query.k).list_level:
            width = max(width, RULES_WIDTH * query.k)
        return width

    def prefill(self, history: Sequence[int], width: int) -> None:
        """Compute and keep ``history``'s next plain request: with ``width`` > 0 its search of that many beams
        under the server's exclusions and prior (a request of any k up to it then runs no forward), else its
        timeline state alone. Nothing counted; nothing run when it is kept already or there is no cache."""
        if self.scope.settings.states is None:
            return
        if width > 0:
            self._plain([RecQuery(history=list(history), k=width, mode="plain")], width, count=False)
        else:
            self._states([history], count=False)

    # ---- without rules: the searches kept ---------------------------------------------------------------------
    def _plain(self, queries: list[RecQuery], width: int, count: bool = True) -> list[RecResult]:
        """Queries without rules: each search output from the cache where kept, the others searched together."""
        scope = self.scope
        cache = scope.settings.states
        excluded = scope.excluded(queries)
        keys: list[Hashable] = []  # the search keys, only with a cache
        kept: list[Kept | None] = [None] * len(queries)
        if cache is not None:
            keys = [self._search_key(q, width, ex) for q, ex in zip(queries, excluded, strict=True)]
            kept = [cache.row(key, count) for key in keys]
        calls = [0] * len(queries)
        todo = [r for r, x in enumerate(kept) if x is None]
        if todo:
            out, ran = self._search([queries[r].history for r in todo], width,
                                    scope.sparse_dead([excluded[r] for r in todo]), count)
            for j, r in enumerate(todo):
                calls[r] = out.decoder_calls + ran[j]
                if cache is not None:  # [W], [W]: a copy, not the batch's storage
                    kept[r] = (out.leaves[j].clone(), out.scores[j].clone())
                    cache.keep_row(keys[r], kept[r])
                else:
                    kept[r] = (out.leaves[j], out.scores[j])
        results = []
        for r, q in enumerate(queries):
            row = kept[r]
            assert row is not None
            leaves, scores = row[0].tolist(), row[1].tolist()
            ok = [j for j, leaf in enumerate(leaves) if leaf >= 0][: q.k]
            items = scope.parts.trie.items_of_leaves([leaves[j] for j in ok], excluded[r])
            results.append(self._result(q, width, items, [scores[j] for j in ok], calls[r]))
        return results

    def _search_key(self, query: RecQuery, width: int, excluded: Sequence[int]) -> Hashable:
        """What a search output depends on: the model, the catalog's trie, the prior and its weight, the history
        (the whole of it with a fused prior, else the items the timeline reads), the width and the exclusions.
        The objects themselves, not their ids: a kept key holds them, so no other object takes their place."""
        parts, weight = self.scope.parts, self.scope.prior_weight
        fused = parts.prior is not None and weight > 0
        seen = tuple(query.history) if fused else kept_items(parts.trie, query.history, self.model.config.max_items)
        return ("timeline-search", self.model, parts.trie, parts.prior if fused else None, weight if fused else 0.0,
                seen, width, tuple(sorted(set(excluded))))

    # ---- with rules -------------------------------------------------------------------------------------------
    def _ruled(self, queries: list[RecQuery], width: int) -> list[RecResult]:
        """Queries with rules: the filters (and exclusions) as dead nodes, then each list's boosts and caps
        (``_pick``); never kept (the attributes file may change between requests)."""
        scope = self.scope
        compiled = scope.compiled(scope.catalog(), queries, scope.excluded(queries))
        out, ran = self._search([q.history for q in queries], width, compiled.dead)
        results = []
        for r, q in enumerate(queries):
            leaves, scores = out.leaves[r].tolist(), out.scores[r].tolist()
            ok = [j for j, leaf in enumerate(leaves) if leaf >= 0]
            items, item_scores = self._pick(compiled, r, q.k, [leaves[j] for j in ok], [scores[j] for j in ok])
            results.append(self._result(q, width, items, item_scores, out.decoder_calls + ran[r]))
        return results

    def _pick(self, compiled: BatchRules, r: int, k: int, leaves: list[int], scores: list[float]
              ) -> tuple[list[int], list[float]]:
        """Request ``r``'s list from its searched leaves (best first): each leaf's item (the filters' choice among
        collided items) with its boost added, re-sorted (stable: ties keep the search's order), then the caps'
        greedy pick of k."""
        trie = self.scope.parts.trie
        cols = torch.tensor(leaves, dtype=torch.long) - trie.num_internal  # [m] leaf columns
        rows = compiled.leaf_row[r, cols].cpu().numpy()  # [m] catalog rows (n: none alive)
        total = np.asarray(scores, dtype=np.float64) + compiled.leaf_boost[r, cols].cpu().numpy()
        order = np.argsort(-total, kind="stable")
        ranked = rows[order]
        picked = greedy_pick(ranked, compiled.caps[r], k, none=len(trie.ids))
        return trie.ids.item_ids[ranked[picked]].tolist(), total[order][picked].tolist()

    # ---- the timeline and the search --------------------------------------------------------------------------
    def _search(self, histories: list[Sequence[int]], width: int, dead: torch.Tensor | SparseDead | None,
                count: bool = True) -> tuple[TimelineOutput, list[int]]:
        """One beam search of ``width`` beams over these histories' states (dead [B, num_nodes] or sparse:
        excluded nodes; the fused prior of the histories); and the timeline calls each history spent (0 or 1)."""
        states, ran = self._states(histories, count)
        prior = self.scope.prior_for(histories)  # [B, num_nodes] or None
        return beam_search(self.model, self.scope.parts.trie, states, width, dead, prior), ran

    def _states(self, histories: Sequence[Sequence[int]], count: bool = True) -> tuple[torch.Tensor, list[int]]:
        """[B, H] each history's timeline state, from the user-state cache where kept, the others in one timeline
        forward (then kept); and the timeline calls each history spent (0 or 1)."""
        parts, cache = self.scope.parts, self.scope.settings.states
        trie, max_items = parts.trie, self.model.config.max_items
        keys: list[Hashable] = []  # the state keys, only with a cache
        rows: list[torch.Tensor | None] = [None] * len(histories)
        if cache is not None:
            keys = [("timeline-state", self.model, trie, kept_items(trie, h, max_items)) for h in histories]
            rows = [cache.row(key, count) for key in keys]
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing:
            fresh = user_states(self.model, trie, [histories[i] for i in missing], parts.timeline_ids)  # [m, H]
            if cache is None:  # none kept: the forward's states as they are
                return fresh, [1] * len(histories)
            for j, i in enumerate(missing):
                rows[i] = fresh[j].clone()  # [H]: not the batch's storage
                cache.keep_row(keys[i], rows[i])
        ran = set(missing)
        return torch.stack([r for r in rows if r is not None]), [int(i in ran) for i in range(len(histories))]

    @staticmethod
    def _result(query: RecQuery, width: int, items: list[int], scores: list[float], calls: int) -> RecResult:
        decoding = Decoding("plain", width, fallback=WHY_PLAIN.get(query.mode, ""))
        return RecResult(item_ids=items, scores=scores, stats=RecStats(target_calls=calls, rounds=calls),
                         decoding=decoding)
