"""The token target's forced passes over the engine's beam cache: the partial sums of given leaves' code log-probs
(``leaf_logprobs``) and an unfused wide beam with its partial sums (``wide_beam``). ``TokenRanker``
(``training.evaluation.rankers``) reads the token target through them; the re-scored tunings' candidates
(``training.tuning.rescore_cache``) are built from them.

Shapes: B users of a batch, n leaves per user, W beams, L levels, C codes.
"""

from __future__ import annotations

import torch

from recsvc.engine.caches.beam_cache import BeamCache
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.expand import expand_beams
from recsvc.engine.search.beam_search import hidden_logprobs
from tokenizer_rqvae.trie import CatalogTrie
from training.evaluation.traced import partial_sums


def leaf_logprobs(model: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch,
                  leaves: torch.Tensor) -> torch.Tensor:
    """[B, n] trie leaves (-1: none) -> [B, n, L] float32 sums of the target's log-probs of each leaf's codes
    1..d after its row's prompt, for d = 1..L (the last: the leaf's log-prob; -inf at -1). One prefill, then the
    distinct prefixes of each depth 1..L-1 fed as one step each (``BeamCache.feed``: a prefix attends its prompt
    and its own path, as a beam does)."""
    b, n = leaves.shape
    levels = trie.levels
    ok = leaves >= 0
    anc = trie.ancestors[leaves.clamp(min=0)]  # [B, n, L] the depth 1..L nodes of each leaf's path
    codes = trie.node_code[anc]  # [B, n, L] each level's code
    cache = BeamCache(model, trie, code_offset, prompts)
    root = torch.zeros(b, 1, dtype=torch.long)
    logp = hidden_logprobs(model, trie, code_offset, cache.prefill()[:, None], root)  # [B, 1, C]
    total = logp[:, 0].gather(1, codes[..., 0].clamp(min=0))  # [B, n] the first code's log-prob
    partial = [total]
    parents_of = torch.zeros(b, n, dtype=torch.long)  # each leaf's depth-(d-1) prefix: its column in that step
    for depth in range(1, levels):
        at = torch.where(ok, anc[..., depth - 1], -1)  # [B, n] the depth-d prefix of each leaf
        width = max(1, max(int(torch.unique(row[row >= 0]).numel()) for row in at))
        nodes = torch.full((b, width), -1, dtype=torch.long)
        parents = torch.zeros(b, width, dtype=torch.long)
        column = torch.zeros(b, n, dtype=torch.long)
        for r in range(b):
            uniq, inverse = torch.unique(at[r][ok[r]], return_inverse=True)  # sorted distinct prefixes
            nodes[r, : len(uniq)] = uniq
            column[r, ok[r]] = inverse
            first = torch.zeros(len(uniq), dtype=torch.long)  # one leaf under each prefix: its parent's column
            first.scatter_(0, inverse, parents_of[r][ok[r]])
            parents[r, : len(uniq)] = first
        hidden = cache.feed(nodes, parents)  # [B, K, H]
        step = hidden_logprobs(model, trie, code_offset, hidden, nodes)  # [B, K, C]
        total = total + step.gather(1, column[..., None].expand(-1, -1, step.shape[2])).gather(
            2, codes[..., depth : depth + 1].clamp(min=0))[..., 0]
        partial.append(total)
        parents_of = column
    out = torch.stack(partial, dim=2)  # [B, n, L]
    return torch.where(ok[..., None], out, torch.full_like(out, float("-inf")))


def wide_beam(model: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch, width: int,
              dead: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's unfused constrained beam search at ``width`` -> for each depth d = 1..L, (the beams' nodes
    [B, width] (-1: fewer), the partial sums [B, width, L] of their code log-probs up to each depth <= d, read
    back along the beams' parents; -inf beyond d). The last depth's nodes are the leaves."""
    cache = BeamCache(model, trie, code_offset, prompts)
    b = len(prompts.lengths)
    nodes = torch.zeros(b, 1, dtype=torch.long)
    scores = torch.zeros(b, 1)
    parents = torch.zeros(b, 1, dtype=torch.long)
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (nodes, scores, parents) per depth
    for step in range(trie.levels):
        hidden = cache.prefill()[:, None] if step == 0 else cache.feed(nodes, parents)
        logp = hidden_logprobs(model, trie, code_offset, hidden, nodes)
        nodes, scores, parents = expand_beams(trie, nodes, scores, logp, width, dead)
        steps.append((nodes, scores, parents))
    return partial_sums(steps, trie.levels)
