"""The dense head's nearest items ranked with every beam of the width, by one score
(``DenseRetriever.merge``): plain and strict requests without rules, when the target has an active dense
head."""

from __future__ import annotations

from collections.abc import Sequence

from recsvc.content.dense_head import DenseRetriever
from recsvc.engine.entry.dispatch import Decoded, Mode
from recsvc.engine.entry.final_read import read_decoded
from recsvc.engine.meters.host_reads import uncounted
from recsvc.recommender.api import RecQuery, RecResult, RecStats
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie


class DenseMerge:
    def __init__(self, dense: DenseRetriever | None, trie: CatalogTrie, ids: SemanticIds) -> None:
        self.dense = dense if dense is not None and dense.active else None
        self.trie, self.ids = trie, ids

    def applies(self, queries: Sequence[RecQuery], mode: Mode) -> bool:
        """Whether this batch's beams are merged with the head's items (plain and strict, no rules)."""
        return self.dense is not None and mode in ("plain", "strict") and not any(q.rules for q in queries)

    def __call__(self, queries: Sequence[RecQuery], out: Decoded, excluded: list[list[int]]) -> list[RecResult]:
        """``out``: the width's leaves and scores [B, W] and the prompts' final hidden states [B, H] that the
        decoding's prefill computed (plain and strict always return them) -> one merged list per query."""
        assert self.dense is not None and out.prompt_hidden is not None
        host = read_decoded(out, hidden=True)  # the request's one read: every beam, the head's query
        results = []
        with uncounted():  # the head runs on the host (host tensors, on a CPU run too)
            sims = self.dense.similarities(host.prompt_hidden)  # [B, n]
            for r, q in enumerate(queries):
                leaves, scores = host.row(r)
                items = self.trie.items_of_leaves(leaves, excluded[r])
                merged, merged_scores = self.dense.merge(items, scores, sims[r], self.ids, q.k, excluded[r])
                calls = out.target_calls[r]
                stats = RecStats(target_calls=calls, draft_calls=out.draft_calls, accepted_steps=out.accepted[r],
                                 rounds=calls)
                results.append(RecResult(item_ids=merged, scores=merged_scores, stats=stats, decoding=out.decoding))
        return results
