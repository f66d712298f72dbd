"""Queries of one mode and beam width decoded by the engine's one entry (``recsvc.engine.entry.dispatch``): exclusions
and the rules' filters as dead trie nodes, the fused prior, the relaxed mode's temperatures and seeds; the
first k of the width's beams of each query (or, with the dense head, every beam merged with its items)."""

from __future__ import annotations

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.entry.dispatch import Mode, decode
from recsvc.engine.entry.final_read import read_decoded
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.search.sampling import make_generators
from recsvc.recommender.api import RecQuery, RecResult, RecStats
from recsvc.recommender.stages.dense_merge import DenseMerge
from recsvc.recommender.stages.scope import Scope


class EngineDecode:
    def __init__(self, scope: Scope, engine: BeamSearch) -> None:
        self.scope, self.engine = scope, engine
        parts = scope.parts
        self.merge = DenseMerge(parts.dense, parts.trie, parts.ids)

    def __call__(self, queries: list[RecQuery], mode: Mode, width: int, ledger: Ledger = NO_LEDGER
                 ) -> list[RecResult]:
        scope, parts = self.scope, self.scope.parts
        spec, device = scope.settings.spec, parts.target.device
        batch = PromptBatch.from_lists([parts.prompts.prompt_ids(q.history) for q in queries], device)
        excluded = scope.excluded(queries)
        if any(q.rules is not None and q.rules.has_filters for q in queries):  # filters: dead nodes, as exclusions
            compiled = scope.compiled(scope.catalog(), queries, excluded)
            dead, excluded = compiled.dead, compiled.excluded
        else:
            dead = scope.dead(excluded)
        histories = [q.history for q in queries]
        sampling = mode == "relaxed"
        merging = self.merge.applies(queries, mode)
        out = decode(self.engine, parts.drafter, batch, histories, mode, width, spec.for_width(width),
                     why_plain=spec.plain_reason(width), dead=dead, prior=scope.prior_for(histories),
                     temperatures=(torch.tensor([float(q.temperature) for q in queries], device=device)
                                   if sampling else None),
                     generators=make_generators([q.seed for q in queries]) if sampling else None,
                     top=None if merging else max(q.k for q in queries),  # the first k of the width are read
                     ledger=ledger, states=scope.settings.states, keep=scope.settings.relaxed_keep)
        if merging:
            return self.merge(queries, out, excluded)
        host = read_decoded(out, max(q.k for q in queries))  # the request's one read of its lists
        results = []
        for r, q in enumerate(queries):  # the first k of the width's beams, best first
            leaves, scores = host.row(r, q.k)
            stats = RecStats(target_calls=out.target_calls[r], draft_calls=out.draft_calls,
                             accepted_steps=out.accepted[r], rounds=out.target_calls[r])
            results.append(RecResult(item_ids=parts.trie.items_of_leaves(leaves, excluded[r]), scores=scores,
                                     stats=stats, decoding=out.decoding))
        return results
