"""Speculative beam search with strict top-K verification (AtSpeed Algorithm 1): lossless.

One round, for every unfinished request (rows may sit at different depths j):
  draft   -> the drafter proposes N beams for each of the next g = min(gamma, L - j) depths
  tree    -> the drafted nodes (trie prefixes, so already deduplicated) plus the current beams form a tree
  verify  -> ONE target forward over the tree (fused with the prompt prefill in the first round)
  accept  -> replay the target's own beam search on the tree: at each depth, the target's top-K over the
             children of its accepted beams (``expand_beams``, the plain engine's step); accept the depth iff
             every one of those K is among the drafted N. The first rejected depth's top-K is still the
             target's exact result, and if all g depths pass, one more depth comes free from the
             distributions at the last drafted depth.
  commit  -> keep the KV slots of the surviving beams' paths, drop the rest; finished rows leave the batch.
The output is the plain beam search's (same items, order and, up to float error, scores), with or without a
fused item prior (the replay adds the same per-step prior terms as the plain search; drafts need not know it,
though a drafter given the prior drafts the fused beams and is accepted more often).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsvc.engine.beam_search import node_logprobs, to_device
from recsvc.engine.engine_model import EngineModel
from recsvc.engine.expand import expand_beams
from recsvc.engine.ledger import NO_LEDGER, Ledger
from recsvc.engine.ports import DraftSession, TargetState
from recsvc.engine.prompts import PromptBatch
from recsvc.engine.rounds import ActiveBeams
from recsvc.engine.state_cache import UserStateCache
from recsvc.engine.topk import Selector
from recsvc.engine.tree_cache import TreeCache
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class SpecOutput:
    leaves: torch.Tensor  # [B, K] trie leaves, best first (-1: fewer valid items)
    scores: torch.Tensor  # [B, K] float32 beam scores
    target_calls: torch.Tensor  # [B] target forward calls per request (rounds, + any a drafter's TargetState made)
    accepted: torch.Tensor  # [B] draft depths accepted per request (AS)
    draft_calls: int  # drafter forward calls for the batch


def accepted_depth(target_beams: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """Strict check: every valid target beam [B, K] is among the drafted nodes [B, N] -> [B] bool.

    Example: target [[4, 7]], drafted [[7, 9, 4]] -> [True]; target [[4, 8]] -> [False]."""
    hit = (target_beams[:, :, None] == drafted[:, None, :]).any(-1) | (target_beams < 0)
    return hit.all(1)


@torch.inference_mode()
def speculative_search(
    target: EngineModel,
    trie: CatalogTrie,
    code_offset: int,
    prompts: PromptBatch,
    width: int,
    drafts: DraftSession,
    draft_beams: int,  # N
    gamma: int,  # draft depths per round
    dead: torch.Tensor | None = None,  # [B, num_nodes]
    select: Selector | None = None,  # the plain engine's tie-break (BeamSearch.select)
    prior: torch.Tensor | None = None,  # [B, num_nodes] fused prior (recsvc.engine.prior), as given to plain
    ledger: Ledger = NO_LEDGER,  # phase timers (recsvc.engine.ledger); results never depend on it
    states: UserStateCache | None = None,  # the user-state cache (recsvc.engine.state_cache; fast forward)
) -> SpecOutput:
    # Host synchronisation (CUDA), the eager forwards: a round reads the device only where a decision needs it:
    # how many tokens the verification feeds (TreeCache.missing: a shape; the lean forward also groups them by
    # key count: TreeCache._groups), whether any row can take another depth (``go.any()``: the replay loop's
    # exit) and which rows finished (ActiveBeams.retire: the batch's new shape); drafters read how many depths
    # to draft (``steps.max()``). Acceptance, scores and counters stay on the device.
    dev = target.device  # inputs moved once; every tensor of the search lives there
    trie, prompts = trie.to(dev), prompts.to(dev)
    dead, prior = to_device(dead, dev), to_device(prior, dev)
    b, levels = len(prompts.lengths), trie.levels
    cache = TreeCache(target, trie, code_offset, prompts, states)
    state = TargetState(target, cache)  # follows the cache's rows (select_rows)
    beams = ActiveBeams.start(b, dev, dead=dead, prior=prior)
    out_leaves = torch.full((b, width), -1, dtype=torch.long, device=dev)
    out_scores = torch.full((b, width), float("-inf"), device=dev)
    calls = torch.zeros(b, dtype=torch.long, device=dev)
    accepted = torch.zeros(b, dtype=torch.long, device=dev)
    # Sync-free (``target.sync_free``: the bucketed / CUDA-graph forwards): the host knows every row's depth
    # from the one read a round makes (``retire``), so the drafter is told its depth count, the verification
    # feeds its bound (the tree's width when the drafter's trees hold their parents: ``closed_tree``), the
    # replay runs its gamma + 1 depths without asking whether a row still goes, and the caches keep their slots.
    sync = target.sync_free
    if sync:
        beams.host_depth = [0] * b
    closed = bool(getattr(drafts, "closed_tree", False))
    while len(beams.rows):  # a shape: no sync
        dead, row_prior = beams.per_row["dead"], beams.per_row["prior"]
        steps = (levels - beams.depth).clamp(max=gamma)  # [R]
        with ledger.phase("draft"):
            if sync and beams.host_depth is not None:
                depths = max(min(levels - d, gamma) for d in beams.host_depth)
                drafted = drafts.propose(beams.nodes, beams.scores, steps, draft_beams, state, depths=depths)
            else:
                drafted = drafts.propose(beams.nodes, beams.scores, steps, draft_beams, state)  # g x [R, N]
        with ledger.phase("verify"):
            tree = torch.cat([beams.nodes, *drafted], 1)
            cache.feed(torch.where(trie.depth[tree.clamp(min=0)] < levels, tree, -1),  # leaves need no forward
                       bound=tree.shape[1] if sync and closed else None)
        running = torch.ones(len(beams.rows), dtype=torch.bool, device=dev)
        for s in range(1, gamma + 2):
            go = running & (beams.depth < levels)
            if not sync and not go.any():  # host sync: the decision to stop replaying this round
                break
            with ledger.phase("replay"):
                live = torch.where(go[:, None], beams.nodes, -1)  # finished rows take no step
                logp = node_logprobs(target, cache, live)  # [R, Kc, C]
                new_nodes, new_scores, _ = expand_beams(trie, live, beams.scores, logp, width, dead, select, row_prior)
                ok = go & (steps >= s)
                if s <= len(drafted):
                    ok &= accepted_depth(new_nodes, drafted[s - 1])
                else:
                    ok &= False  # the free depth after all g drafted depths passed
                beams.advance(go, new_nodes, new_scores)
            accepted[beams.rows] += ok.long()
            running = ok
        calls[beams.rows] = cache.row_calls  # every target forward a row took part in, so far
        with ledger.phase("commit"):
            rows, leaves, scores = beams.retire(levels, cache, drafts, sync)
        out_leaves[rows], out_scores[rows] = leaves, scores
    if sync and closed and not cache.check_bound():  # one read per search; a drafter's broken promise
        raise RuntimeError("a drafter marked closed_tree proposed a node whose parent it did not propose")
    return SpecOutput(out_leaves, out_scores, calls, accepted, drafts.calls)
