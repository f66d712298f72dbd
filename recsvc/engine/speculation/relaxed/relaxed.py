"""Speculative sampling beam search with relaxed verification (AtSpeed Algorithm 2; docs/SPECULATIVE.md).

Per depth s of a round (every unfinished request; p: target, q: drafter, both trie-masked and renormalised
sequence distributions over the children of their own current beams):
  - the drafter has sampled N >= K sequences from q_s without replacement;
  - each drafted y is accepted with probability min(1, p_s(y) / q_s(y));
  - >= K accepted: keep K of them (``keep``: K uniformly at random as the paper's listing, the default, or the
    first K in the drafter's draw order; ``keep``), go to the next depth;
  - else: the missing K - a are sampled without replacement from p' = norm(max(0, p_s - q_s)) with the accepted
    ones zeroed, and the round stops here.
If all g drafted depths pass, one more depth is sampled from the target directly (its distributions at the last
drafted depth are already computed). The accepted set is reset at every depth (the paper's listing does not);
N >= K drafts are tested against ">= K" (the listing samples K and tests "> K").
The result follows the target's sampling beam search distribution approximately (with-replacement
approximation); tests compare item frequencies over many seeds. With a fused item prior, p is the target's
prior-fused, renormalised distribution (``sampling.tempered_logp``), the same one ``sampling_beam_search``
samples from; q is whatever the drafter sampled from (the LLaMA drafter fuses the same prior when given it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import to_device
from recsvc.engine.search.sampling import gumbel, rank_final, sample_children, tempered_logp, uniform
from recsvc.engine.speculation.ports import DraftStep, SamplingSession, TargetState
from recsvc.engine.speculation.relaxed.keep import DEFAULT_KEEP, Keep, pick_accepted
from recsvc.engine.speculation.relaxed.unrolled import unrolled_relaxed
from recsvc.engine.speculation.rounds import ActiveBeams
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class RelaxedOutput:
    leaves: torch.Tensor  # [B, K] ranked by target sequence log-prob
    logp: torch.Tensor  # [B, K]
    target_calls: torch.Tensor  # [B]
    accepted: torch.Tensor  # [B] depths accepted without resampling
    draft_calls: int
    # target_calls and accepted as the host read them (the sync-free request's one read), else None
    host_counts: tuple[list[int], list[int]] | None = None


@torch.inference_mode()
def relaxed_speculative_search(
    target: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch, width: int,
    drafts: SamplingSession,
    draft_beams: int, gamma: int, temperature: torch.Tensor, gens: Sequence[torch.Generator],
    dead: torch.Tensor | None = None,
    prior: torch.Tensor | None = None,  # [B, num_nodes] fused prior: p_s is the fused target (sampling.py)
    states: UserStateCache | None = None,  # the user-state cache (recsvc.engine.caches.state_cache; fast forward)
    unrolled: bool = True,  # sync-free targets: rounds unrolled (``unrolled``); False: the eager loop
    keep: Keep = DEFAULT_KEEP,  # which K of >= K accepted drafts a depth keeps (``keep``)
) -> RelaxedOutput:
    dev = target.device  # inputs moved once; every tensor of the search lives there
    trie, prompts, temperature = trie.to(dev), prompts.to(dev), temperature.to(dev)
    dead, prior = to_device(dead, dev), to_device(prior, dev)
    b, levels = len(prompts.lengths), trie.levels
    n_draft = max(draft_beams, width)
    cache = TreeCache(target, trie, code_offset, prompts, states)
    beams = ActiveBeams.start(b, dev, dead=dead, temp=temperature.clone(), prior=prior)
    if unrolled and target.plan.sync_free:  # rounds unrolled on the device, three units a round, one read
        leaves, logp_seq, calls_t, acc_t, calls_h, acc_h = unrolled_relaxed(cache, beams, drafts, width, n_draft,
                                                                            gamma, gens, _verify_depth, keep)
        return RelaxedOutput(leaves, logp_seq, calls_t, acc_t, drafts.calls, (calls_h, acc_h))
    out_leaves = torch.full((b, width), -1, dtype=torch.long, device=dev)
    out_logp = torch.full((b, width), float("-inf"), device=dev)
    calls = torch.zeros(b, dtype=torch.long, device=dev)
    accepted = torch.zeros(b, dtype=torch.long, device=dev)
    while len(beams.rows):
        dead, temp, row_prior = beams.per_row["dead"], beams.per_row["temp"], beams.per_row["prior"]
        grow = beams.rows.tolist()  # host sync: the rows' CPU generators are picked by request index
        steps = (levels - beams.depth).clamp(max=gamma)
        drafted: list[DraftStep] = drafts.sample(beams.nodes, beams.scores, steps, n_draft, temp,
                                                 [gens[r] for r in grow], TargetState(target, cache))
        tree = torch.cat([beams.nodes, *[d.nodes for d in drafted]], 1)
        cache.feed(torch.where(trie.depth[tree.clamp(min=0)] < levels, tree, -1))
        running = torch.ones(len(grow), dtype=torch.bool, device=dev)
        for s in range(1, gamma + 2):
            go = running & (beams.depth < levels)
            if not go.any():
                break
            live = torch.where(go[:, None], beams.nodes, -1)
            logp, child = tempered_logp(target, cache, live, temp, dead, row_prior)  # [R, Kc, C]
            cand_w = (beams.scores[..., None] + logp).reshape(len(grow), -1)  # log P(child), unnormalised
            cand_nodes = child.reshape(len(grow), -1)
            verify = go & (steps >= s) & (s <= len(drafted))
            if not verify.any():  # the free depth (or nothing drafted): sample from the target directly
                new_nodes, new_w = sample_children(cand_w, cand_nodes, width, gens, grow)
                ok = torch.zeros_like(go)
            else:
                new_nodes, new_w, ok = _verify_depth(cand_w, cand_nodes, beams.nodes, drafted[s - 1], width, gens, grow,
                                                     keep)
                free = go & ~verify
                if free.any():
                    fn, fw = sample_children(cand_w, cand_nodes, width, gens, grow)
                    new_nodes = torch.where(free[:, None], fn, new_nodes)
                    new_w = torch.where(free[:, None], fw, new_w)
                ok &= verify
            beams.advance(go, new_nodes, new_w)
            accepted[beams.rows] += ok.long()
            running = ok
        calls[beams.rows] = cache.row_calls  # every target forward a row took part in, so far
        rows, leaves, logp_seq = beams.retire(levels, cache, drafts)
        if len(rows):
            out_leaves[rows], out_logp[rows] = rank_final(leaves, logp_seq)
    return RelaxedOutput(out_leaves, out_logp, calls, accepted, drafts.calls)


def _verify_depth(cand_w: torch.Tensor, cand_nodes: torch.Tensor, beams: torch.Tensor, step: DraftStep, width: int,
                  gens, rows, keep: Keep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One depth of relaxed verification. cand_w / cand_nodes: [R, Kc*C] target candidates (children of the
    target's beams ``beams`` [R, Kc]); ``keep``: the rule for >= K accepted drafts (``keep``). Returns (new
    beams [R, K], their log P [R, K], accepted-all [R])."""
    r, n_cand = cand_w.shape
    c = step.parent_logq.shape[2]
    lse_p = torch.logsumexp(cand_w, 1, keepdim=True)
    logp = torch.where(torch.isfinite(lse_p), cand_w - lse_p, float("-inf"))  # [R, n_cand] normalised p_s
    # q_s at the target's candidates: a target beam that is also a drafter parent has q mass on its children
    match = (beams[:, :, None] == step.parents[:, None, :]) & (beams[:, :, None] >= 0)  # [R, Kc, n]
    has = match.any(-1)
    idx = match.float().argmax(-1)  # [R, Kc]
    q_children = step.parent_logq.gather(1, idx[..., None].expand(-1, -1, c))  # [R, Kc, C]
    logq_cand = torch.where(has[..., None], q_children, float("-inf")).reshape(r, n_cand)
    # drafted sequences: p(y) from the candidates (0 if y's parent is not a target beam), q(y) from the drafter
    hit = (step.nodes[:, :, None] == cand_nodes[:, None, :]) & (step.nodes[:, :, None] >= 0)  # [R, N, n_cand]
    in_cand = hit.any(-1)
    pos = hit.float().argmax(-1)
    p_y = torch.where(in_cand, logp.gather(1, pos).exp(), 0.0)
    q_y = step.logq.exp()
    u = uniform((step.nodes.shape[1],), gens, rows, cand_w.device)
    acc = (step.nodes >= 0) & (u < torch.where(q_y > 0, p_y / q_y, 0.0).clamp(max=1.0)) & in_cand  # [R, N]
    n_acc = acc.sum(1)
    enough = n_acc >= width
    # >= K accepted: K of them, by the keep rule (uniform draws N Gumbel numbers here, draw-order none)
    pick = pick_accepted(acc, width, keep, gens, rows)  # [R, K] (garbage rows without enough)
    nodes_a = step.nodes.gather(1, pick)
    w_a = cand_w.gather(1, pos.gather(1, pick))
    # < K accepted: keep them, draw the rest from norm(max(0, p - q)) without the accepted ones
    acc_cand = (hit & acc[..., None]).any(1)  # [R, n_cand] candidates that were drafted and accepted
    resid = (logp.exp() - logq_cand.exp()).clamp(min=0.0)
    resid = torch.where(acc_cand, 0.0, resid)
    fallback = resid.sum(1, keepdim=True) <= 0  # p == q where it matters: draw from p itself
    resid = torch.where(fallback, torch.where(acc_cand, 0.0, logp.exp()), resid)
    log_resid = torch.where(resid > 0, resid.log(), float("-inf"))
    # order: accepted first (key +inf), then residual samples by Gumbel key, then (only if the residual's
    # support is too small to fill K) samples from p itself; take K
    noise = gumbel((n_cand,), gens, rows, cand_w.device)
    from_p = torch.where(torch.isfinite(logp) & ~acc_cand, logp + noise - 1.0e6, float("-inf"))
    keys = torch.where(torch.isfinite(log_resid), log_resid + noise, from_p)
    keys = torch.where(acc_cand, float("inf"), keys)
    top = torch.topk(keys, min(width, n_cand), dim=1)
    nodes_r = torch.where(torch.isfinite(top.values) | (top.values > 0), cand_nodes.gather(1, top.indices), -1)
    w_r = torch.where(nodes_r >= 0, cand_w.gather(1, top.indices), float("-inf"))
    if nodes_r.shape[1] < width:
        pad = width - nodes_r.shape[1]
        nodes_r = torch.cat([nodes_r, torch.full((r, pad), -1, dtype=torch.long, device=nodes_r.device)], 1)
        w_r = torch.cat([w_r, torch.full((r, pad), float("-inf"), device=w_r.device)], 1)
    new_nodes = torch.where(enough[:, None], nodes_a, nodes_r)
    new_w = torch.where(enough[:, None], w_a, w_r)
    return new_nodes, new_w, enough
