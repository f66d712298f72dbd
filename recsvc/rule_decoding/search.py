"""List-level beam search: trie-constrained beam search that returns k items satisfying a request's caps,
ordered by target score + boosts (docs/RULES.md).

Per depth, for every request:
  score   -> the children of the beams with their beam scores (``candidate_scores``: trie, filters as dead
             nodes, fused prior), ranked by score + the largest boost still reachable below (an upper bound)
  look    -> optional: a ``Lookahead`` completes the best candidates to items (CDLH: the target; CDSL: the
             draft head, verified by the target), the caps score those items, and the candidates after the
             first ``width`` are re-ranked: those whose completion fits the list first (``lookahead.reorder``);
             only for requests whose caps will keep more than ``width`` beams (elsewhere the order after
             ``width`` is never used), unless ``lookahead_always``
  keep    -> the first ``width`` candidates, and more while their items cannot yet fill a capped list of k
             (``greedy.capacity_prefix``): the beam never loses the items a compliant list needs
  final   -> at the last depth, every leaf of the beams, best score + boost first, taken greedily under the caps
Because the kept beams always hold the items of a compliant k-list when the catalog has one, the result has
exactly k items whenever k compliant items exist (one cap over a single-valued attribute: see greedy.py).

Shapes: B requests, W beams (ragged per request, padded with -1), C codes per level, n = W * C candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.scoring.expand import candidate_scores
from recsvc.engine.search.beam_search import node_logprobs, to_device
from recsvc.rule_decoding.lookahead import Lookahead, reorder
from recsvc.rules.catalog import BatchRules, RuleCatalog
from recsvc.rules.greedy import capacity_prefix, greedy_pick


@dataclass(frozen=True)
class ListOutput:
    rows: torch.Tensor  # [B, k] catalog rows of the items, best first (catalog.n: fewer than k items)
    scores: torch.Tensor  # [B, k] float32 target score + boosts (-inf where rows == catalog.n)
    target_calls: torch.Tensor  # [B] target forward calls per request (lookahead roll-outs included)
    beams: torch.Tensor  # [B, L - 1] beams kept at depths 1..L-1 (> width where the caps needed more)


def keep_beams(order: torch.Tensor, key: torch.Tensor, cand: torch.Tensor, child: torch.Tensor, width: int,
               k: int, rules: BatchRules, catalog: RuleCatalog) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates [B, n] in ``order`` -> (beams [B, W], their scores [B, W], beams kept per request [B]).

    A request keeps its first ``width`` valid candidates, or as many more as ``capacity_prefix`` asks for."""
    b = order.shape[0]
    valid = torch.isfinite(key.gather(1, order)).sum(1).tolist()  # invalid candidates are ordered last
    kept = []
    for r in range(b):
        w = min(width, valid[r])
        if not rules.caps[r].empty and valid[r] > w:
            nodes = child[r, order[r, : valid[r]]].tolist()
            leaf_row = rules.leaf_row[r].cpu().numpy()
            groups = (catalog.leaves_under(node, leaf_row) for node in nodes)
            w = min(max(w, capacity_prefix(groups, rules.caps[r], k)), valid[r])
        kept.append(w)
    wmax = max(max(kept), 1)
    top = order[:, :wmax]
    dev = order.device
    kept_t = torch.tensor(kept, device=dev)
    live = torch.arange(wmax, device=dev)[None] < kept_t[:, None]  # [B, W]
    nodes = torch.where(live, child.gather(1, top), -1)
    scores = torch.where(live, cand.gather(1, top), float("-inf"))
    return nodes, scores, kept_t


def rank_list(leaves: torch.Tensor, scores: torch.Tensor, k: int, rules: BatchRules, catalog: RuleCatalog
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Finished candidates: leaves / scores [B, n] (-1 / -inf: none) -> (rows [B, k], score + boost [B, k]), best
    score + boost first, taken greedily under the caps (rows == catalog.n where fewer than k fit)."""
    trie = catalog.trie
    leaf = (leaves - trie.num_internal).clamp(min=0)
    ok = (leaves >= trie.num_internal) & torch.isfinite(scores)
    row = torch.where(ok, rules.leaf_row.gather(1, leaf), catalog.n)
    adj = torch.where(ok, scores + rules.leaf_boost.gather(1, leaf), -torch.inf)
    order = torch.sort(adj, dim=1, descending=True, stable=True).indices
    out_rows = torch.full((len(leaves), k), catalog.n, dtype=torch.long, device=leaves.device)
    out_scores = torch.full((len(leaves), k), float("-inf"), device=leaves.device)
    for r in range(len(leaves)):
        picked = order[r, greedy_pick(row[r, order[r]].cpu().numpy(), rules.caps[r], k, none=catalog.n)]
        out_rows[r, : len(picked)] = row[r, picked]
        out_scores[r, : len(picked)] = adj[r, picked]
    return out_rows, out_scores


@torch.inference_mode()
def list_search(
    target: EngineModel,
    catalog: RuleCatalog,
    code_offset: int,
    prompts: PromptBatch,
    k: int,  # items per list
    width: int,  # beams kept at least (>= k)
    rules: BatchRules,
    prior: torch.Tensor | None = None,  # [B, num_nodes] fused prior (recsvc.engine.scoring.prior)
    lookahead: Lookahead | None = None,
    ledger: Ledger = NO_LEDGER,
    lookahead_always: bool = False,  # True: look ahead at every depth, even where it cannot change the list
) -> ListOutput:
    trie = catalog.trie  # on the model's device (the recommender builds the catalog over its trie)
    dev = target.device
    prompts, prior = prompts.to(dev), to_device(prior, dev)
    b, levels = len(prompts.lengths), trie.levels
    cache = TreeCache(target, trie, code_offset, prompts)
    nodes = torch.zeros(b, 1, dtype=torch.long, device=dev)  # the root
    scores = torch.zeros(b, 1, device=dev)
    kept = torch.zeros(b, levels - 1, dtype=torch.long, device=dev)
    for depth in range(levels):
        with ledger.phase("forward"):
            cache.feed(nodes)  # the prefill first; later beams are often cached by a lookahead already
        with ledger.phase("head"):
            logp = node_logprobs(target, cache, nodes)  # [B, W, C]
        cand, child = candidate_scores(trie, nodes, scores, logp, rules.dead, prior)
        cand, child = cand.reshape(b, -1), child.reshape(b, -1)  # [B, n]
        if depth == levels - 1:
            break
        with ledger.phase("select"):
            key = torch.where(torch.isfinite(cand), cand + rules.bonus(child), float("-inf"))
            order = torch.sort(key, dim=1, descending=True, stable=True).indices  # [B, n]
        if lookahead is not None:
            with ledger.phase("lookahead"):
                order = reorder(lookahead, cache, order, key, cand, child, rules, catalog, width,
                                None if lookahead_always else k)
        with ledger.phase("select"):
            nodes, scores, kept[:, depth] = keep_beams(order, key, cand, child, width, k, rules, catalog)
    with ledger.phase("select"):
        rows, adj = rank_list(child, cand, k, rules, catalog)
    return ListOutput(rows, adj, cache.row_calls.clone(), kept)


def item_ids(catalog: RuleCatalog, rows: torch.Tensor) -> list[list[int]]:
    """[B, k] catalog rows (catalog.n: none) -> item ids per request."""
    ids = np.append(catalog.trie.ids.item_ids, -1)
    return [[int(i) for i in ids[r.cpu().numpy()] if i >= 0] for r in rows]
