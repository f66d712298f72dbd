"""What the drafters' sessions share: their per-row tensors kept in step with the batch's rows, and one depth of
a relaxed (sampled) draft."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsvc.engine.search.noise import NoiseStream, gated
from recsvc.engine.search.sampling import sample_children
from recsvc.engine.speculation.ports import DraftStep


def take_rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """``t[rows]``: a per-row tensor (dead nodes, the prior's term) after the batch kept ``rows``; None stays."""
    return None if t is None else t[rows]


def sampled_depth(nodes: torch.Tensor, weights: torch.Tensor, logq: torch.Tensor, child: torch.Tensor,
                  active: torch.Tensor, width: int, gens: Sequence[torch.Generator] | NoiseStream,
                  drawing: torch.Tensor) -> tuple[DraftStep, torch.Tensor, torch.Tensor]:
    """One depth of a relaxed draft: ``width`` children per row sampled without replacement from the previous
    depth's ``nodes`` [R, n] weighted by ``weights`` [R, n] plus the drafter's tempered log-probs ``logq`` of their
    children ``child`` [R, n, C]; rows not ``active`` [R, 1] draft nothing (-1); ``drawing`` [R]: the rows for
    which a NoiseStream's draws count (the eager loop draws only while some row samples: ``noise.gated``).
    -> (the depth's DraftStep, with its weights and the candidates' scores normalised per row; the sampled nodes
    [R, width]; their weights)."""
    r = nodes.shape[0]
    cand = weights[..., None] + logq  # [R, n, C]
    lse = torch.logsumexp(cand.reshape(r, -1), 1)  # [R]
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    with gated(gens, drawing):
        new_nodes, new_w = sample_children(cand.reshape(r, -1), child.reshape(r, -1), width, gens, range(r))
    step = DraftStep(torch.where(active, new_nodes, -1), new_w - lse[:, None], nodes, cand - lse[:, None, None])
    return step, new_nodes, new_w
