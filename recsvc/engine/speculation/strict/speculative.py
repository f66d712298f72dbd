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
from functools import partial

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.cuda_graphs import FunctionGraphs
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.scoring.expand import expand_beams
from recsvc.engine.scoring.topk import Selector
from recsvc.engine.search.beam_search import hidden_logprobs, to_device
from recsvc.engine.speculation.ports import DraftSession, TargetState
from recsvc.engine.speculation.rounds import ActiveBeams
from recsvc.engine.speculation.strict.unrolled import unrolled_rounds
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class SpecOutput:
    leaves: torch.Tensor  # [B, K] trie leaves, best first (-1: fewer valid items)
    scores: torch.Tensor  # [B, K] float32 beam scores
    target_calls: torch.Tensor  # [B] target forward calls per request (rounds, + any a drafter's TargetState made)
    accepted: torch.Tensor  # [B] draft depths accepted per request (AS)
    draft_calls: int  # drafter forward calls for the batch
    prompt_hidden: torch.Tensor | None = None  # [B, H] final hidden state at each prompt's last token
    # target_calls and accepted as the host read them (the sync-free request's one read), else None
    host_counts: tuple[list[int], list[int]] | None = None


def accepted_depth(target_beams: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """Strict check: every valid target beam [B, K] is among the drafted nodes [B, N] -> [B] bool.

    Example: target [[4, 7]], drafted [[7, 9, 4]] -> [True]; target [[4, 8]] -> [False]."""
    hit = (target_beams[:, :, None] == drafted[:, None, :]).any(-1) | (target_beams < 0)
    return hit.all(1)


def _replay_step(target: EngineModel, trie: CatalogTrie, code_offset: int, width: int, select: Selector | None,
                 s: int, hidden: torch.Tensor, live: torch.Tensor, scores: torch.Tensor, dead: torch.Tensor | None,
                 prior: torch.Tensor | None, go: torch.Tensor, steps: torch.Tensor, draft: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One replay depth as a pure function of its tensors (captured per (depth, width) under the sync-free
    forwards): the target's step over its live beams ``live`` [R, Kc] (hidden [R, Kc, H]) -> (new beams
    [R, K], their scores [R, K], whether depth ``s`` is accepted [R]: the draft ``draft`` [R, N] holds every new
    beam; no draft: the free depth, never accepted)."""
    logp = hidden_logprobs(target, trie, code_offset, hidden, live)  # [R, Kc, C]
    new_nodes, new_scores, _ = expand_beams(trie, live, scores, logp, width, dead, select, prior)
    ok = go & (steps >= s)
    ok = ok & accepted_depth(new_nodes, draft) if draft is not None else torch.zeros_like(ok)
    return new_nodes, new_scores, ok


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
    prior: torch.Tensor | None = None,  # [B, num_nodes] fused prior (recsvc.engine.scoring.prior), as given to plain
    ledger: Ledger = NO_LEDGER,  # phase timers (recsvc.engine.meters.ledger); results never depend on it
    states: UserStateCache | None = None,  # the user-state cache (recsvc.engine.caches.state_cache; fast forward)
    graphs: FunctionGraphs | None = None,  # sync-free: each replay depth one function (a CUDA graph on a GPU)
    exit_check: int | None = None,  # sync-free: one extra read after that many rounds may end the request early
) -> SpecOutput:
    # Sync-free forwards (``target.plan.sync_free``: bucketed / CUDA graphs):
    # ``recsvc.engine.speculation.strict.unrolled`` (rounds unrolled on the device, three fixed-shape units a round, one
    # host read per request). The eager forwards (below) read the device where a decision needs it: how many tokens the
    # verification feeds (TreeCache.missing: a shape; the lean forward also groups them by key count:
    # TreeCache._groups), whether any row can take another depth (``go.any()``: the replay loop's exit) and which rows
    # finished (ActiveBeams.retire: the batch's new shape); drafters read how many depths to draft (``steps.max()``).
    # Acceptance, scores and counters stay on the device.
    dev = target.device  # inputs moved once; every tensor of the search lives there
    trie, prompts = trie.to(dev), prompts.to(dev)
    dead, prior = to_device(dead, dev), to_device(prior, dev)
    b, levels = len(prompts.lengths), trie.levels
    cache = TreeCache(target, trie, code_offset, prompts, states)
    state = TargetState(target, cache)  # follows the cache's rows (select_rows)
    beams = ActiveBeams.start(b, dev, dead=dead, prior=prior)
    if target.plan.sync_free:  # rounds unrolled on the device, a handful of units, one host read per request
        leaves, scores, calls_t, acc_t, calls_h, acc_h, hid = unrolled_rounds(
            cache, state, beams, drafts, width, draft_beams, gamma, select, ledger, graphs, _replay_step, exit_check)
        return SpecOutput(leaves, scores, calls_t, acc_t, drafts.calls, hid, (calls_h, acc_h))
    out_leaves = torch.full((b, width), -1, dtype=torch.long, device=dev)
    out_scores = torch.full((b, width), float("-inf"), device=dev)
    calls = torch.zeros(b, dtype=torch.long, device=dev)
    accepted = torch.zeros(b, dtype=torch.long, device=dev)
    prompt_hidden: torch.Tensor | None = None  # read after the first verification, which prefills every row
    while len(beams.rows):  # a shape: no sync
        dead, row_prior = beams.per_row["dead"], beams.per_row["prior"]
        steps = (levels - beams.depth).clamp(max=gamma)  # [R]
        with ledger.phase("draft"):
            drafted = drafts.propose(beams.nodes, beams.scores, steps, draft_beams, state)  # g x [R, N]
        with ledger.phase("verify"):
            tree = torch.cat([beams.nodes, *drafted], 1)
            cache.feed(torch.where(trie.depth[tree.clamp(min=0)] < levels, tree, -1))  # leaves need no forward
            if prompt_hidden is None and cache.last_prompt_hidden is not None:
                prompt_hidden = cache.last_prompt_hidden.clone()  # [B, H]: no row has retired yet
        running = torch.ones(len(beams.rows), dtype=torch.bool, device=dev)
        for s in range(1, gamma + 2):
            go = running & (beams.depth < levels)
            if not go.any():  # host sync: the decision to stop replaying this round
                break
            with ledger.phase("replay"):
                live = torch.where(go[:, None], beams.nodes, -1)  # finished rows take no step
                hidden = cache.hidden_at(live)  # [R, Kc, H]
                draft = drafted[s - 1] if s <= len(drafted) else None  # None: the free depth after all g passed
                step = partial(_replay_step, target, trie, code_offset, width, select, s)
                inputs = (hidden, live, beams.scores, dead, row_prior, go, steps, draft)
                new_nodes, new_scores, ok = step(*inputs)
                beams.advance(go, new_nodes, new_scores)
            accepted[beams.rows] += ok.long()
            running = ok
        calls[beams.rows] = cache.row_calls  # every target forward a row took part in, so far
        with ledger.phase("commit"):
            rows, leaves, scores = beams.retire(levels, cache, drafts)
        out_leaves[rows], out_scores[rows] = leaves, scores
    return SpecOutput(out_leaves, out_scores, calls, accepted, drafts.calls, prompt_hidden)
