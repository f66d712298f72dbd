"""One step of trie-constrained beam search over given next-code log-probs: score every allowed child (the trie,
the request's exclusions, the fused prior's step term) and keep the best K. Shared by plain beam search, its
bounded last step, speculative verification, the drafters and the rules' list-level search.

Shapes: B requests, k_in / m beams in, C codebook size, width beams out.
"""

from __future__ import annotations

import torch

from recsvc.engine.scoring.exclusion import SparseDead
from recsvc.engine.scoring.prior import step_bias
from recsvc.engine.scoring.topk import IndexSelector, Selector, select_topk
from tokenizer_rqvae.trie import CatalogTrie


def expand_beams(
    trie: CatalogTrie,
    nodes: torch.Tensor,  # [B, k_in] current beams (trie nodes; -1 dead)
    scores: torch.Tensor,  # [B, k_in]
    logp: torch.Tensor,  # [B, k_in, C] next-code log-probs of each beam
    width: int,
    dead: torch.Tensor | SparseDead | None,  # [B, num_nodes] excluded prefixes (or the same, sparse)
    select: Selector | None = None,  # tie-break (default: lower index)
    prior: torch.Tensor | None = None,  # [B, num_nodes] w * log prior mass (recsvc.engine.scoring.prior) or None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One beam-search step: (nodes [B, width], scores [B, width], parent beam index [B, width]).

    With ``prior`` each candidate also gains prior[row, child] - prior[row, node], so scores are fused scores
    (sum of code log-probs + w * log m(prefix)); without it the step is exactly the unfused one."""
    cand, child = candidate_scores(trie, nodes, scores, logp, dead, prior)
    return select_candidates(trie, nodes, cand, child, width, select)


def select_candidates(
    trie: CatalogTrie,
    nodes: torch.Tensor,  # [B, k_in] the beams the candidates extend (-1 dead)
    cand: torch.Tensor,  # [B, k_in, C] candidate scores (-inf: not allowed)
    child: torch.Tensor,  # [B, k_in, C] their nodes
    width: int,
    select: Selector | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selecting half of ``expand_beams``: the best ``width`` candidates -> (nodes [B, width], scores
    [B, width], parent beam index [B, width]); -1 nodes where fewer than ``width`` are allowed."""
    b, k_in, c = cand.shape
    if select is None or isinstance(select, IndexSelector):  # lower index first: no level to read
        new_scores, flat = select_topk(cand.reshape(b, k_in * c), width)
    else:
        level = trie.depth[nodes.max(dim=1).values.clamp(min=0)]  # [B] a row's beams share one depth
        new_scores, flat = select(cand, width, level)
    new_nodes = child.view(b, k_in * c).gather(1, flat)
    new_nodes = torch.where(torch.isfinite(new_scores), new_nodes, -1)
    return new_nodes, new_scores, flat // c


def select_from_best(
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # the best T scores, flat indices [B, T], tie flag []
    child: torch.Tensor,  # [B, k_in, C] the candidates' nodes
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``select_candidates`` from the best T candidates already taken (sorted, as ``torch.topk`` returns them):
    when T >= 2 width + 1 and those are real and pairwise distinct (the flag), both selectors keep the best
    ``width`` as they come (``GenerateSelector``: generate's two top-k calls and its final merge reduce to that;
    ``IndexSelector``: no tie to break). None otherwise: the caller selects from all candidates."""
    values, flat, distinct = best
    if values.shape[1] < 2 * width + 1 or not bool(distinct):
        return None
    b, _, c = child.shape
    flat = flat[:, :width]
    return child.view(b, -1).gather(1, flat), values[:, :width], flat // c


def candidate_scores(
    trie: CatalogTrie,
    nodes: torch.Tensor,  # [B, m] trie nodes (-1 dead)
    scores: torch.Tensor,  # [B, m]
    logp: torch.Tensor,  # [B, m, C] next-code log-probs of each node
    dead: torch.Tensor | SparseDead | None,  # [B, num_nodes] (or the same, sparse)
    prior: torch.Tensor | None,  # [B, num_nodes] or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every child's beam score (-inf where the trie or ``dead`` forbids it; + the prior's step term) and node:
    ([B, m, C], [B, m, C] child nodes, -1 where absent). The scoring half of ``expand_beams``."""
    b, m, c = logp.shape
    if isinstance(dead, SparseDead):
        mask, child = trie.allowed(nodes.reshape(-1))
        mask = mask.view(b, m, c) & dead.alive(nodes, c)
    else:
        rows = torch.arange(b, device=nodes.device)[:, None].expand(b, m).reshape(-1) if dead is not None else None
        mask, child = trie.allowed(nodes.reshape(-1), dead, rows)
        mask = mask.view(b, m, c)
    step = scores[..., None] + logp
    if prior is not None:
        step = step + step_bias(prior, nodes, child.view(b, m, c))
    return torch.where(mask, step, float("-inf")), child.view(b, m, c)
