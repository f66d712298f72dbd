"""Look-aheads for list-level beam search: complete candidate prefixes to items, let the rules score them.

A prefix cannot say which item it will end in, but a look-ahead can guess: the greedy completion of a
candidate (at each depth the child of best score + reachable boost) is a real item under it, with an exact
target score once the target has seen its path. Two ways to get the completions (docs/RULES.md):
- ``TargetLookahead`` (CDLH, constrained decoding with look-ahead heuristics): the target rolls every candidate
  out, one target forward per remaining depth;
- ``DraftLookahead`` (CDSL, constrained decoding with speculative look-aheads): the recurrent draft head rolls
  them out (no transformer forward) and the target verifies only where the search goes: the beams it keeps
  are scored by the target at the next depth, and lists hold target-scored items only. Or (``verify="paths"``)
  ONE target forward scores every drafted path, and where the target's own greedy step leaves a drafted path,
  up to ``corrections`` more forwards follow the target (after that, the drafted item is kept, with its exact
  target score); with unlimited corrections the completions, hence the lists, are CDLH's.
``reorder`` then ranks the looked-ahead candidates after the beam's own best ones by their completion's score +
boost, those whose completion still fits the caps (a greedy pass over the completions) first: the look-ahead
picks the extra beams a cap needs.

Shapes: B requests, M looked-ahead candidates per request, C codes, L levels, H hidden size.
"""

from __future__ import annotations

from typing import Protocol

import torch

from recsvc.drafters.head_model import DraftHead
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.expand import candidate_scores
from recsvc.engine.search.beam_search import node_logprobs
from recsvc.rules.catalog import BatchRules, RuleCatalog
from recsvc.rules.greedy import fills, greedy_pick
from recsvc.rules.spec import VERIFY_MODES


class Lookahead(Protocol):
    width: int  # M: candidates completed per request and depth

    def complete(self, cache: TreeCache, nodes: torch.Tensor, scores: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """nodes / scores [B, M] candidates of one depth (-1 none) -> (leaves [B, M], target scores [B, M])."""
        ...


def _cached(cache: TreeCache, nodes: torch.Tensor) -> torch.Tensor:
    """[B, m] -> [B, m] bool: the node's hidden state is in the cache (or it needs none: -1 / root)."""
    slot = cache.slot_of_node.gather(1, nodes.clamp(min=0))
    return (nodes <= 0) | (slot >= 0)


def greedy_walk(target: EngineModel, cache: TreeCache, rules: BatchRules, prior: torch.Tensor | None,
                nodes: torch.Tensor, scores: torch.Tensor, drafted: torch.Tensor | None = None,
                corrections: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The target's greedy completion of each node [B, M]: (leaves [B, M], their target scores [B, M], target
    forwards spent). ``drafted`` [B, M, L + 1] (drafted node per depth, -1 none; already fed): once
    ``corrections`` forwards are spent, a walk that leaves its drafted path and would need a forward follows the
    drafted child instead. None: no limit (the exact greedy completion)."""
    trie = cache.trie
    levels = trie.levels
    cur, s, forwards = nodes.clone(), scores.clone(), 0
    while True:
        active = (cur >= 0) & (trie.depth[cur.clamp(min=0)] < levels)
        if not bool(active.any()):
            return cur, s, forwards
        need = active & ~_cached(cache, cur)
        if bool(need.any()):
            cache.feed(torch.where(need, cur, -1))
            forwards += 1
        live = torch.where(active, cur, -1)
        cand, child = candidate_scores(trie, live, s, node_logprobs(target, cache, live), rules.dead, prior)
        key = torch.where(torch.isfinite(cand), cand + rules.bonus(child.flatten(1)).view(child.shape), -torch.inf)
        best = key.argmax(-1, keepdim=True)  # [B, M, 1]
        nxt, nxt_s = child.gather(2, best)[..., 0], cand.gather(2, best)[..., 0]
        if drafted is not None and corrections is not None and forwards >= corrections:
            depth = trie.depth[cur.clamp(min=0)]  # [B, M]
            guess = drafted.gather(2, (depth + 1).clamp(max=levels)[..., None])[..., 0]
            off = (active & (guess >= 0) & (nxt != guess) & (trie.depth[nxt.clamp(min=0)] < levels)
                   & ~_cached(cache, nxt))
            at = (child == guess[..., None]).int().argmax(-1, keepdim=True)
            nxt = torch.where(off, guess, nxt)
            nxt_s = torch.where(off, cand.gather(2, at)[..., 0], nxt_s)
        cur, s = torch.where(active, nxt, cur), torch.where(active, nxt_s, s)


class TargetLookahead:
    """CDLH: the target completes every candidate itself."""

    def __init__(self, target: EngineModel, rules: BatchRules, prior: torch.Tensor | None, width: int) -> None:
        self.target, self.rules, self.prior, self.width = target, rules, prior, width
        self.forwards = 0

    def complete(self, cache: TreeCache, nodes: torch.Tensor, scores: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        leaves, out, forwards = greedy_walk(self.target, cache, self.rules, self.prior, nodes, scores)
        self.forwards += forwards
        return leaves, out


class DraftLookahead:
    """CDSL: the draft head completes the candidates (no transformer forward) and the rules score the drafted
    items. ``verify="beams"``: the target verifies where the search goes, as it scores the kept beams at the
    next depth (the look-ahead costs the target nothing; a completion's score is the candidate's exact score +
    the head's log-probs below it). ``verify="paths"``: ONE target forward scores every drafted path exactly
    first, with ``corrections`` forwards to follow the target where its greedy step leaves a path (None: all, the
    completions are then CDLH's)."""

    def __init__(self, target: EngineModel, head: DraftHead, rules: BatchRules, prior: torch.Tensor | None,
                 width: int, verify: str = "beams", corrections: int | None = 0) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be {' or '.join(map(repr, VERIFY_MODES))}, got {verify!r}")
        self.target, self.head, self.rules, self.prior = target, head, rules, prior
        self.width, self.verify, self.corrections = width, verify, corrections
        self.forwards = 0
        self.head_steps = 0

    def draft(self, cache: TreeCache, nodes: torch.Tensor, scores: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, M] candidates of depth d with their scores -> ([B, M, L + 1] the head's greedy path, node per depth
        and -1 elsewhere; [B, M] the drafted item's score: the candidate's + the head's log-probs (+ prior)).
        The head starts from the target's hidden state at each candidate's parent (a cached beam) and consumes
        the candidate's code, then its own choices."""
        trie, head = cache.trie, self.head
        b, m = nodes.shape
        levels, d = trie.levels, int(trie.depth[nodes.clamp(min=0)].max())
        paths = torch.full((b, m, levels + 1), -1, dtype=torch.long, device=nodes.device)
        paths[..., d] = nodes
        h = cache.hidden_at(torch.where(nodes >= 0, trie.parent[nodes.clamp(min=0)], -1))  # [B, M, H]
        h = h.to(head.out.dtype).reshape(b * m, -1)
        state = head.start(h)  # [B M, S]
        cur, s = nodes, scores
        for depth in range(d, levels):  # consume the code of the depth-`depth` node, draft depth + 1
            safe = cur.clamp(min=1)
            level = torch.full((b * m,), depth - 1, dtype=torch.long, device=nodes.device)
            state, logq = head.step(state, h, level, trie.node_code[safe].reshape(-1))
            self.head_steps += 1
            cand, child = candidate_scores(trie, cur, s, logq.view(b, m, -1).float(), self.rules.dead, self.prior)
            key = torch.where(torch.isfinite(cand), cand + self.rules.bonus(child.flatten(1)).view(child.shape),
                              -torch.inf)
            best = key.argmax(-1, keepdim=True)
            cur = torch.where(cur >= 0, child.gather(2, best)[..., 0], -1)
            s = cand.gather(2, best)[..., 0]
            paths[..., depth + 1] = cur
        return paths, s

    def complete(self, cache: TreeCache, nodes: torch.Tensor, scores: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        levels = cache.trie.levels
        drafted, drafted_scores = self.draft(cache, nodes, scores)
        if self.verify == "beams":
            return drafted[..., levels], drafted_scores
        cache.feed(drafted[..., :levels].flatten(1))  # ONE target forward over every drafted path
        self.forwards += 1
        leaves, out, forwards = greedy_walk(self.target, cache, self.rules, self.prior, nodes, scores, drafted,
                                            self.corrections)
        self.forwards += forwards
        return leaves, out


def needs_extra_beams(order: torch.Tensor, key: torch.Tensor, child: torch.Tensor, rules: BatchRules,
                      catalog: RuleCatalog, keep: int, k: int) -> list[bool]:
    """Per request: whether its first ``keep`` candidates in ``order`` fall short of a capped list of k items, so
    that ``search.keep_beams`` will keep more beams, chosen by the order after ``keep``. Where they do not (no
    caps, or the first ``keep`` already hold k items that fit), nothing after ``keep`` is kept and a look-ahead
    cannot change the result."""
    valid = torch.isfinite(key.gather(1, order)).sum(1).tolist()
    out = []
    for r in range(len(order)):
        if rules.caps[r].empty or valid[r] <= keep:
            out.append(False)
            continue
        nodes = child[r, order[r, :keep]].tolist()
        leaf_row = rules.leaf_row[r].cpu().numpy()
        out.append(not fills((catalog.leaves_under(n, leaf_row) for n in nodes), rules.caps[r], k))
    return out


def reorder(lookahead: Lookahead, cache: TreeCache, order: torch.Tensor, key: torch.Tensor, cand: torch.Tensor,
            child: torch.Tensor, rules: BatchRules, catalog: RuleCatalog, keep: int, k: int | None = None
            ) -> torch.Tensor:
    """Candidates [B, n] ranked by ``key`` (``order``) -> re-ranked after the first ``keep`` (the beam's own,
    which stay): the rest of the first M, completed, by their completion's score + boost, those whose item fits
    the caps next to the completions of better value (a greedy pass over all M) ahead of the others; then the
    remaining candidates in ``order``. So the look-ahead chooses the extra beams a cap needs, never drops one of
    the best-scored prefixes on the strength of a guess.

    ``k`` (items per list): complete only the requests whose caps will need extra beams (``needs_extra_beams``;
    the others' lists cannot depend on the look-ahead); None: complete every request (a full look-ahead)."""
    trie = catalog.trie
    m = min(lookahead.width, order.shape[1])
    top = order[:, :m]
    valid = torch.isfinite(key.gather(1, top))  # [B, M]
    if k is not None:
        need = torch.tensor(needs_extra_beams(order, key, child, rules, catalog, keep, k), device=order.device)
        if not bool(need.any()):
            return order
        valid &= need[:, None]
    nodes = torch.where(valid, child.gather(1, top), -1)
    leaves, scores = lookahead.complete(cache, nodes, cand.gather(1, top))
    leaf = (leaves - trie.num_internal).clamp(min=0)
    value = torch.where(valid & (leaves >= trie.num_internal), scores + rules.leaf_boost.gather(1, leaf),
                        -torch.inf)
    rows = rules.leaf_row.gather(1, leaf)
    out = order.clone()
    for r in range(len(order)):
        nv = int(valid[r].sum())  # valid candidates come first in ``order``
        if nv <= keep:
            continue
        by_value = torch.sort(value[r, :nv], descending=True, stable=True).indices
        fits = torch.zeros(nv, dtype=torch.bool, device=order.device)
        fits[by_value[greedy_pick(rows[r, by_value].cpu().numpy(), rules.caps[r], nv, none=catalog.n)]] = True
        rest = by_value[by_value >= keep]
        out[r, keep:nv] = top[r, torch.cat([rest[fits[rest]], rest[~fits[rest]]])]
    return out
