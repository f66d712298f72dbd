"""Which K of the accepted drafts relaxed verification keeps at a depth where >= K were accepted.

The drafter samples its N drafts of a depth without replacement from q (Gumbel-top-N, ``sampling.sample_children``),
so their index order is their draw order. Two rules:

- ``draw-order``: the first K accepted in draw order. That is K draws without replacement from q
  restricted to the accepted drafts (sequential sampling without replacement, then dropping the rejected ones),
  the same size-biased draw the target's own sampling beam search makes, and it draws no random numbers.
- ``uniform`` (the default, what the service and the benches run unless told): K of the accepted uniformly at
  random (the listing of "Efficient Inference for Large Language
  Model-based Generative Recommendation", AtSpeed Algorithm 2). With N = 2K drafts nearly all accepted, this keeps
  a uniform half of q's first 2K draws: the beams lean to q's tail (measured on Beauty: docs/SPECULATIVE.md).
  It draws N Gumbel numbers per verified depth.

    >>> acc = torch.tensor([[False, True, True, False, True, True]])
    >>> pick_accepted(acc, 2, "draw-order", [], []).tolist()
    [[1, 2]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from recsvc.engine.search.noise import NoiseStream
from recsvc.engine.search.sampling import gumbel

Keep = Literal["draw-order", "uniform"]
KEEPS: tuple[Keep, ...] = ("draw-order", "uniform")
# the paper's rule until the served lists move with a re-recorded golden file (tests/test_decoding_golden.py):
# draw-order follows the target's sampling more closely, by the measurements in docs/SPECULATIVE.md
DEFAULT_KEEP: Keep = "uniform"


def pick_accepted(acc: torch.Tensor, width: int, keep: Keep, gens: Sequence[torch.Generator] | NoiseStream,
                  rows: Sequence[int]) -> torch.Tensor:
    """[R, N] accepted drafts (index order = draw order) -> [R, width] indices of the kept ones (meaningful for the
    rows with >= width accepted). ``uniform`` draws N Gumbel numbers per row from ``gens``; ``draw-order`` none."""
    n = acc.shape[1]
    if keep == "draw-order":
        rank = -torch.arange(n, dtype=torch.float32, device=acc.device)  # earlier draws first
        keys = torch.where(acc, rank, float("-inf"))
    elif keep == "uniform":
        keys = torch.where(acc, gumbel((n,), gens, rows, acc.device), float("-inf"))
    else:
        raise ValueError(f"keep must be one of {KEEPS}, got {keep!r}")
    return torch.topk(keys, width, dim=1).indices


def pick_draws(keep: Keep, n_draft: int) -> int:
    """Random numbers one row draws for a verified depth's pick (the unrolled search's noise budget)."""
    return n_draft if keep == "uniform" else 0
