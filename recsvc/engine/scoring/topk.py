"""Beam selection, shared by plain beam search and speculative verification (so both break ties alike).

Two tie-breaks, both documented and tested:
- ``IndexSelector``: higher score first, equal scores to the lower flat index (lower beam, then lower code).
- ``GenerateSelector`` (the engine's default): reproduces transformers' selection exactly, ties included:
  for K = 1 greedy search's argmax (the lowest token id among equal scores); for K > 1 beam search: the
  candidates laid out as generate lays them out ([K beams x full vocabulary], the first step's missing beams
  at -1e9), top-2K by ``torch.topk``, then top-K of those (the last step: generate's merge of finished
  hypotheses); without ties among the best 2K+1 this is simply "best K by score". bf16 logits are coarse,
  so exact ties do occur; this makes the engine return what ``generate`` returns even then (at the cost of
  one [K, V] row per request per step when ties occur).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsvc.engine.meters.host_reads import uncounted

NEG = -1.0e9  # transformers' "very large negative" for unused beams
INVALID = -1.0e8  # anything at or below this is a padding beam, not a real candidate


def distinct_best(values: torch.Tensor) -> torch.Tensor:
    """values [B, T] sorted descending -> 0-d bool: every row's T values are real candidates (> ``INVALID``) and
    pairwise distinct, so "the best K by score" needs no tie-break (``GenerateSelector``, the compiled scoring
    graph)."""
    return (values[:, -1] > INVALID).all() & (values[:, 1:] != values[:, :-1]).all()


def select_topk(cand: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cand: [B, n] scores (-inf = not allowed) -> (scores [B, width], flat indices [B, width]).

    Example: ``select_topk(tensor([[0., 2., 2., -inf]]), 2) == ([[2., 2.]], [[1, 2]])``.
    If n < width the result is padded with -inf scores (index 0)."""
    b, n = cand.shape
    if b == 1 and n > width and cand.device.type == "cpu":  # one request on the host: its allowed ones only
        with uncounted():  # a CPU-only read (host_reads): on a GPU every candidate is sorted
            picked = _select_allowed(cand[0], width)
        if picked is not None:
            return picked
    padded = n < width
    if padded:
        pad = torch.full((b, width - n), float("-inf"), dtype=cand.dtype, device=cand.device)
        cand = torch.cat([cand, pad], dim=1)
    scores, idx = torch.sort(cand, dim=1, descending=True, stable=True)
    scores, idx = scores[:, :width], idx[:, :width]
    return scores, torch.where(idx < n, idx, torch.zeros_like(idx)) if padded else idx


def _select_allowed(row: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """row [n] -> ``select_topk`` of that one row ([1, width] each) on the host, over its allowed candidates only
    (the ones above -inf: a trie step's are a few of its m * C): the stable sort restricted to them keeps their
    order, so the first ``width`` are the same when there are that many (None otherwise: sort them all)."""
    cols = (row != float("-inf")).nonzero().view(-1)  # [K] the allowed candidates, ascending
    if cols.numel() < width:
        return None
    vals, order = row.index_select(0, cols).sort(descending=True, stable=True)  # [K] best first, ties: lower index
    return vals[:width][None], cols.index_select(0, order[:width])[None]


class IndexSelector:
    def __call__(self, cand: torch.Tensor, width: int, level: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cand [B, k_in, C], level [B] (code level being chosen) -> (scores [B, width], flat index into k_in * C)."""
        b, k_in, c = cand.shape
        return select_topk(cand.reshape(b, k_in * c), width)


@dataclass(frozen=True)
class GenerateSelector:
    vocab_size: int  # V: the LM head's rows
    code_offset: int
    codebook_size: int
    levels: int

    def __call__(self, cand: torch.Tensor, width: int, level: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if width == 1:  # generate runs greedy search for one beam: argmax, i.e. ties go to the lowest token id
            return IndexSelector()(cand, width, level)
        if cand.is_cuda:  # the tie test reads the device (a host sync per step); generate's layout is what the
            return self._as_generate(cand, width, level)  # fast path reduces to, and costs a GPU little
        with uncounted():  # a CPU-only read (host_reads): on CUDA the branch above runs
            fast = self._without_ties(cand, width)
        return fast if fast is not None else self._as_generate(cand, width, level)

    @staticmethod
    def _without_ties(cand: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """When every row's best 2K+1 candidates are finite and pairwise distinct, generate's two top-k calls
        (and its final merge) reduce to "best K by score": no layout needed. None otherwise."""
        b, k_in, c = cand.shape
        n = min(2 * width + 1, k_in * c)
        if n < 2 * width + 1:
            return None
        top = torch.topk(cand.reshape(b, k_in * c), n, dim=1)  # sorted, descending
        if not bool(distinct_best(top.values)):
            return None
        return top.values[:, :width], top.indices[:, :width]

    def _as_generate(self, cand: torch.Tensor, width: int, level: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, k_in, c = cand.shape
        v, dev = self.vocab_size, cand.device
        start = self.code_offset + level * c  # [B] first token id of the level's codes
        full = torch.full((b, width, v), float("-inf"), dtype=cand.dtype, device=dev)  # generate's layout
        cols = (start[:, None] + torch.arange(c, device=dev))[:, None, :]  # [B, 1, C]
        if k_in < width:  # first step: generate's beams 1..K-1 hold the same prompt at score -1e9
            cand = torch.cat([cand, (cand[:, :1] + NEG).expand(b, width - k_in, c)], 1)
        full.scatter_(2, cols.expand(b, width, c), cand[:, :width])
        top_v, top_i = torch.topk(full.view(b, width * v), 2 * width)  # [B, 2K]
        # the last step merges with the (empty, -1e9) finished hypotheses, scores / length, as generate does
        fin = top_v / float(self.levels) + (torch.arange(2 * width, device=dev) >= width) * NEG
        merged = torch.cat([torch.full((b, width), NEG, dtype=cand.dtype, device=dev), fin], 1)
        order_last = torch.topk(merged, width).indices - width  # < 0: an empty finished slot, not a candidate
        last = (level == self.levels - 1)[:, None]
        order = torch.where(last, order_last, torch.topk(top_v, width).indices)
        flat = top_i.gather(1, order.clamp(min=0))  # into [K * V]
        scores = torch.where(order >= 0, top_v.gather(1, order.clamp(min=0)), float("-inf"))
        beam, code = flat // v, flat % v - start[:, None]
        ok = (beam < k_in) & (scores > INVALID) & (code >= 0) & (code < c)
        scores = torch.where(ok, scores, float("-inf"))
        flat_in = torch.where(ok, beam * c + code, torch.zeros_like(flat))  # into [k_in * C]
        return scores, flat_in


Selector = IndexSelector | GenerateSelector
