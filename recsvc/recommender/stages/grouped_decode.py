"""A batch decoded by the target: one engine call per group (``grouping``), each by the engine's entry
(``engine_decode``) or, for list-level rules, the rules' search (``rules``); host reads sampled per call;
each list's fallback said (``explanation``); the lists back in the queries' order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from recsvc.engine.meters.host_reads import sampled_reads
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.recommender.api import RecQuery, RecResult
from recsvc.recommender.stages.engine_decode import EngineDecode
from recsvc.recommender.stages.explanation import fallback_said
from recsvc.recommender.stages.grouping import group_queries, split_cached
from recsvc.recommender.stages.rules import RulesDecode
from recsvc.recommender.stages.scope import Scope


class GroupedDecode:
    def __init__(self, scope: Scope, engine: BeamSearch) -> None:
        self.scope = scope
        self.plain = EngineDecode(scope, engine)
        self.listed = RulesDecode(scope, engine)

    def __call__(self, queries: Sequence[RecQuery], ledger: Ledger = NO_LEDGER) -> list[RecResult]:
        scope = self.scope
        settings, device = scope.settings, scope.parts.target.device
        grouped = group_queries(scope, queries)
        results: list[RecResult | None] = [None] * len(queries)
        for group in grouped.groups:
            for part in split_cached(scope, group.mode, group.listed, list(group.rows), queries):
                batch = [queries[i] for i in part]
                run = self.listed if group.listed else self.plain
                with sampled_reads(settings.read_sampler, device) as reads:
                    out = run(batch, group.mode, group.width, ledger)
                if reads is not None:  # a sampled call: its count on each result's stats
                    out = [replace(r, stats=replace(r.stats, host_reads=reads.total)) for r in out]
                for i, res in zip(part, out, strict=True):
                    results[i] = fallback_said(res, queries[i], grouped.plain_because.get(i, ""), group.listed,
                                               settings.rules.strategy)
        return [r for r in results if r is not None]
