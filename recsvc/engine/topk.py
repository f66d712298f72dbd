"""Beam selection with a documented tie-break, shared by plain beam search and speculative verification.

Candidates are ordered by score (higher first); equal scores go to the lower flat index, i.e. the lower beam
index, then the lower code. Both the plain engine and the speculative replay call this one function, so they
break ties identically.
"""

from __future__ import annotations

import torch


def select_topk(cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cand: [B, n] scores (-inf = not allowed) -> (scores [B, k], flat indices [B, k]).

    Example: ``select_topk(tensor([[0., 2., 2., -inf]]), 2) == ([[2., 2.]], [[1, 2]])``.
    If n < k the result is padded with -inf scores (index 0)."""
    b, n = cand.shape
    if n < k:
        pad = torch.full((b, k - n), float("-inf"), dtype=cand.dtype, device=cand.device)
        cand = torch.cat([cand, pad], dim=1)
    scores, idx = torch.sort(cand, dim=1, descending=True, stable=True)
    scores, idx = scores[:, :k], idx[:, :k]
    return scores, torch.where(idx < n, idx, torch.zeros_like(idx))
