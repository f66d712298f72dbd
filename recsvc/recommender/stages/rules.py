"""Queries with caps or boosts (or postfiltered filters) decoded by the rules' list-level search
(``recsvc.rule_decoding.decode``), plain; cdsl's look-ahead runs the drafter's draft head."""

from __future__ import annotations

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.entry.dispatch import Decoding, Mode, decode
from recsvc.engine.meters.host_reads import uncounted
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.recommender.api import RecQuery, RecResult, RecStats
from recsvc.recommender.stages.scope import Scope
from recsvc.rule_decoding.decode import decode_rules
from recsvc.rule_decoding.search import item_ids


class RulesDecode:
    def __init__(self, scope: Scope, engine: BeamSearch) -> None:
        self.scope, self.engine = scope, engine

    def __call__(self, queries: list[RecQuery], mode: Mode, width: int, ledger: Ledger = NO_LEDGER
                 ) -> list[RecResult]:
        """Queries of one k (one group per beam width, and a width is one k or the server's beam width)."""
        if mode == "relaxed":
            raise NotImplementedError("caps and boosts in relaxed (sampling) mode")
        scope, parts = self.scope, self.scope.parts
        spec, drafter = scope.settings.spec, parts.drafter
        k = max(q.k for q in queries)
        batch = PromptBatch.from_lists([parts.prompts.prompt_ids(q.history) for q in queries], parts.target.device)
        catalog = scope.catalog()
        excluded = scope.excluded(queries)
        with ledger.phase("compile"):
            compiled = scope.compiled(catalog, queries, excluded)
        histories = [q.history for q in queries]
        prior = scope.prior_for(histories)
        decoded = [Decoding("plain", width)]  # caps and boosts: the rules' list-level search, plain

        def wide(w: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
            """postfilter: the mode's own decoding of w beams, exclusions as dead nodes, filters applied after"""
            w = max(w, width)
            out = decode(self.engine, drafter, batch, histories, mode, w, spec.for_width(w),
                         why_plain=spec.plain_reason(w), dead=scope.dead(excluded), prior=prior, ledger=ledger)
            decoded[0] = out.decoding
            return out.leaves, out.scores, out.target_calls

        head = drafter.draft_head if drafter is not None else None  # cdsl's look-ahead
        out = decode_rules(scope.settings.rules, parts.target, catalog, parts.prompts.code_offset, batch, k, width,
                           compiled, prior, head, wide, ledger)
        b, n = out.rows.shape
        flat = torch.cat([out.rows.reshape(-1).double(), out.scores.reshape(-1).double()]).cpu()  # one read
        with uncounted():  # host tensors from here on
            listed, listed_scores = item_ids(catalog, flat[: b * n].view(b, n).long()), flat[b * n :].view(b, n)
            host_scores = [listed_scores[r][: len(items)][: q.k].tolist()
                           for r, (q, items) in enumerate(zip(queries, listed, strict=True))]
        results = []
        for r, (q, items) in enumerate(zip(queries, listed, strict=True)):
            scores = host_scores[r]
            stats = RecStats(target_calls=out.target_calls[r], draft_calls=0, accepted_steps=0,
                             rounds=out.target_calls[r])
            results.append(RecResult(item_ids=items[: q.k], scores=scores, stats=stats, decoding=decoded[0]))
        return results
