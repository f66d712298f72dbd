"""Relaxed speculation over a sync-free forward, unrolled like strict (``recsvc.engine.speculation.strict.unrolled``).

``relaxed_speculative_search``'s algorithm (AtSpeed Algorithm 2), laid out as strict's: ``levels`` rounds, each
three units that read nothing from the host and have host-known shapes (``launches.replayable``): the drafter's
sampling (every depth), the verification (tree, static tree cache, target forward) and the replay (the target's
tempered distributions, acceptance or resampling at every depth, counters). Rows never leave the batch: a finished
row samples nothing, feeds nothing and takes no step. One host read at the end: the counters, with the checks.

The eager loop decides on the host which random numbers it draws (a depth draws only while some row goes; the
verification's draws, or the target's own sample when no row verifies; the free rows' sample only if there is
one). Here every alternative is computed and each request's ``NoiseStream`` cursor advances where the eager loop
would have drawn (``noise.gated``), so a seeded request gets the eager loop's numbers, hence its lists.

Shapes: B requests, Kc the current beams (1 at first, then K), N samples per depth, C codes per level.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.meters.launches import replayable
from recsvc.engine.search.noise import NoiseStream, gated
from recsvc.engine.search.sampling import rank_final, sample_children, tempered_logp
from recsvc.engine.speculation.ports import DraftStep, SamplingSession, TargetState
from recsvc.engine.speculation.relaxed.keep import Keep, pick_draws
from recsvc.engine.speculation.rounds import ActiveBeams

VerifyDepth = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # relaxed._verify_depth


def noise_budget(levels: int, gamma: int, width: int, n_draft: int, codes: int, keep: Keep) -> int:
    """Uniforms one request can draw over ``levels`` rounds (an upper bound: every depth of every round drawn,
    by the drafter and by both of the replay's alternatives; a verified depth draws N acceptance uniforms, the
    keep rule's pick (``keep.pick_draws``) and the residual's Gumbel numbers)."""
    total = 0
    for r in range(levels):
        kc = 1 if r == 0 else width  # the target's beams at the round's start
        drafted = min(gamma, levels - r)
        total += sum((kc if s == 1 else n_draft) * codes for s in range(1, drafted + 1))
        for s in range(1, min(gamma + 1, levels - r) + 1):
            cand = (kc if s == 1 else width) * codes
            total += cand + (n_draft + pick_draws(keep, n_draft) + cand if s <= drafted else 0)
    return total


def unrolled_relaxed(cache: TreeCache, beams: ActiveBeams, drafts: SamplingSession, width: int, n_draft: int,
                     gamma: int, gens: Sequence[torch.Generator], verify_depth: VerifyDepth, keep: Keep
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Runs the request's L rounds over ``cache`` (sync-free target) from ``beams`` (every row at the root; per
    row: dead, temp, prior). Returns (leaves [B, K] and their log-probs [B, K] ranked, target calls [B], accepted
    depths [B], both again as host lists). ``keep``: the rule for >= K accepted drafts, as the eager loop's (its
    draws, if any, are the verification's: gated with them)."""
    model, trie = cache.model, cache.trie
    dev, levels, b = model.device, trie.levels, len(beams.rows)
    dead, temp, prior = beams.per_row["dead"], beams.per_row["temp"], beams.per_row["prior"]
    assert temp is not None
    stream = NoiseStream(gens, noise_budget(levels, gamma, width, n_draft, trie.codebook_size, keep), dev)
    state = TargetState(model, cache)
    closed = getattr(drafts, "closed_tree", False)
    accepted = torch.zeros(b, dtype=torch.long, device=dev)
    rows = range(b)
    for r in range(levels):
        drafted_depths = min(gamma, levels - r)
        with replayable(dev):  # the drafter's samples, every depth
            in_batch = beams.depth < levels  # [B] the rows the eager loop still runs (they draw)
            steps = (levels - beams.depth).clamp(max=gamma)  # [B] 0 for finished rows
            with gated(stream, in_batch):
                drafted: list[DraftStep] = drafts.sample(beams.nodes, beams.scores, steps, n_draft, temp, stream,
                                                         state, depths=drafted_depths)
        with replayable(dev):  # the verification: one target forward over the tree
            tree = torch.cat([beams.nodes, *[d.nodes for d in drafted]], 1)
            cache.feed(torch.where(trie.depth[tree.clamp(min=0)] < levels, tree, -1),
                       bound=tree.shape[1] if closed else None)
        with replayable(dev):  # the replay: acceptance or resampling, depth by depth
            running = torch.ones(b, dtype=torch.bool, device=dev)
            for s in range(1, min(gamma + 1, levels - r) + 1):
                go = running & (beams.depth < levels)
                live = torch.where(go[:, None], beams.nodes, -1)
                logp, child = tempered_logp(model, cache, live, temp, dead, prior)  # [B, Kc, C]
                cand_w = (beams.scores[..., None] + logp).reshape(b, -1)  # log P(child), unnormalised
                cand_nodes = child.reshape(b, -1)
                draws = in_batch & go.any()  # the eager loop stops a round's depths once no row goes
                if s <= len(drafted):
                    verify = go & (steps >= s)
                    some = verify.any()
                    free = go & ~verify
                    with gated(stream, draws & some):  # some row verifies: the verification's draws ...
                        ver_nodes, ver_w, ok = verify_depth(cand_w, cand_nodes, beams.nodes, drafted[s - 1], width,
                                                            stream, rows, keep)
                        with gated(stream, free.any().expand(b)):  # ... then the free rows' sample, if any
                            free_nodes, free_w = sample_children(cand_w, cand_nodes, width, stream, rows)
                    with gated(stream, draws & ~some):  # else the target's own sample, from the same place
                        own_nodes, own_w = sample_children(cand_w, cand_nodes, width, stream, rows)
                    new_nodes = torch.where(some, torch.where(free[:, None], free_nodes, ver_nodes), own_nodes)
                    new_w = torch.where(some, torch.where(free[:, None], free_w, ver_w), own_w)
                    ok = ok & verify & some
                else:  # the free depth after all drafted depths: sample from the target directly
                    with gated(stream, draws):
                        new_nodes, new_w = sample_children(cand_w, cand_nodes, width, stream, rows)
                    ok = torch.zeros_like(go)
                beams.advance(go, new_nodes, new_w)
                accepted += ok.long()
                running = ok
            drafts.observe(beams.nodes)
    leaves, logp_seq = rank_final(beams.nodes, beams.scores)
    flags = torch.stack([cache.overflow, stream.overdrawn()]).long()
    host = torch.cat([cache.row_calls, accepted, flags]).tolist()  # the request's one host read
    if host[2 * b]:
        raise RuntimeError("a drafter marked closed_tree sampled a node whose parent it did not sample")
    if host[2 * b + 1]:
        raise RuntimeError("a relaxed request drew more random numbers than its budget")
    return leaves, logp_seq, cache.row_calls, accepted, host[:b], host[b:2 * b]
