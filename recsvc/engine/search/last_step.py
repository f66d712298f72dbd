"""The last step of plain beam search when the caller reads only the best ``top`` of its K beams: exact, and it
runs the last forward on about ``top`` beams instead of K.

Why it is exact. A candidate's score is its parent beam's score plus a code log-prob (<= 0) plus the fused
prior's step term ``w * (log m(child) - log m(parent))`` (<= 0: a child holds part of its parent's prior mass,
w >= 0). So no child scores above its parent. Let L be the ``top``-th best score among the children of the beams
already fed: every beam scoring below L has only children below L, which cannot be among the best ``top``. The
step feeds the best ``top`` + ``FIRST_EXTRA`` beams first (beams are sorted best first), then, when some unfed
beam still scores >= L, the unfed beams down to the last such one, and so on. It stops when every unfed beam is
below L; its result is then the best ``top`` of all candidates, provided those are unambiguous: the best
``top`` + 1 scores of the fed candidates strictly decreasing (then the full step's first ``top``, ties rules
included, are the same items in the same order; the unfed candidates are all below L). Otherwise (a tie, or
fewer than ``top`` finite candidates) it feeds every remaining beam and runs the ordinary step, so ties resolve
as ever.

Measured on the Beauty target (fp32, K = 20, top = 10): the smallest set of last-step beams that can reach the
top 10 is <= 10 beams for 83% of requests and <= 12 for 99.7%; the last forward runs ~12 rows instead of 20
(one request: ~5% of its time, the decode forwards' cost being ~1.1 ms + ~0.1 ms per row in fp32 on one CPU core;
a batch of 8 requests: no gain measured, the batch feeds the rows any of its requests needs).
Only the fast forward uses it (``BeamCache.feed_part``: each part at the whole step's slots and key width, at
least ``MIN_PART`` rows, so a beam's hidden state is the whole step's, bit for bit). The lean forward keeps
``generate``'s batch of K beams, and a search that stores its decode steps in the user-state cache feeds the last
step whole (a repeat request reuses it).

Shapes: B requests, K beams, C codebook size, H hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recsvc.engine.scoring.expand import select_candidates
from recsvc.engine.scoring.topk import Selector
from tokenizer_rqvae.trie import CatalogTrie

# A part runs at least this many beams: the CPU attention kernel takes 1-3 query rows through another code path
# (measured: their outputs differ from the same rows' in a larger call by float rounding); from 4 rows on, a row's
# output does not depend on the call's other rows, so the parts reproduce the whole step's hidden states bit for bit.
MIN_PART = 4
# The first part runs the best top + FIRST_EXTRA beams: a second part costs a forward's fixed cost (~10 rows' worth
# on a CPU), and the bound often needs a beam or two past top (Beauty, K = 20, top = 10: 17% of requests need more
# than top beams, 0.3% more than top + 2).
FIRST_EXTRA = 2

# score(first, stop) -> (cand, child) [B, stop - first, C]: the candidate scores and child nodes of beams
# first..stop-1 (``recsvc.engine.scoring.expand.candidate_scores`` over a forward of those rows)
Score = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def bounded_last_step(
    trie: CatalogTrie,
    nodes: torch.Tensor,  # [B, K] the beams, best first (-1: dead)
    scores: torch.Tensor,  # [B, K] their scores, descending
    score: Score,
    top: int,  # the beams the caller reads (1 <= top < K)
    select: Selector,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(nodes [B, top], scores [B, top], parent beam index [B, top], beams fed): the first ``top`` of what
    ``expand_beams(..., width=K, select)`` returns for the last step, feeding as few beams as the bound allows."""
    b, width = nodes.shape
    c = trie.codebook_size
    cand = torch.full((b, width, c), float("-inf"), dtype=torch.float32, device=nodes.device)  # unfed: -inf
    child = torch.full((b, width, c), -1, dtype=torch.long, device=nodes.device)
    fed = 0
    stop = min(max(top + FIRST_EXTRA, MIN_PART), width)
    while True:
        cand[:, fed:stop], child[:, fed:stop] = score(fed, stop)
        fed = stop
        if fed == width:
            out_nodes, out_scores, parents = select_candidates(trie, nodes, cand, child, width, select)
            return out_nodes[:, :top], out_scores[:, :top], parents[:, :top], fed
        best, flat = torch.topk(cand.view(b, width * c), top + 1, dim=1)  # sorted, descending
        bound = best[:, top - 1]  # [B] L: the top-th best fed candidate
        unsure = ~torch.isfinite(bound) | (best[:, 1:] == best[:, :-1]).any(1)
        reach = (scores[:, fed:] >= bound[:, None]).sum(1)  # [B] unfed beams that may still reach the top
        if bool(unsure.any()):
            stop = width  # ties or too few candidates: the ordinary step, every beam fed
        elif int(reach.max()) > 0:
            stop = min(fed + max(int(reach.max()), MIN_PART), width)  # beams are sorted: those that may reach are next
        else:
            flat = flat[:, :top]
            out_scores = best[:, :top]
            out_nodes = child.view(b, width * c).gather(1, flat)
            return out_nodes, out_scores, flat // c, fed
