"""A traced beam search's beams read back into partial sums: for each depth, every beam's score after each depth
up to it (the re-scored tunings replay the served search's pruning from them, ``training.tuning.rescore``).

Shapes: B users, W beams, L levels.
"""

from __future__ import annotations

import torch

Beams = list[tuple[torch.Tensor, torch.Tensor]]  # per depth d: (nodes [B, W], partial sums [B, W, L])


def partial_sums(steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], levels: int) -> Beams:
    """A traced search's steps (nodes [B, W], scores [B, W], parents [B, W] per depth) -> per depth d, (nodes,
    [B, W, L] the beams' score after each depth <= d, read back along their parents; -inf beyond d)."""
    out = []
    for depth in range(levels):
        nodes, scores, at = steps[depth]
        partial = [scores]
        for back in range(depth - 1, -1, -1):
            _, s, p = steps[back]
            partial.append(s.gather(1, at))
            at = p.gather(1, at)
        sums = torch.full((*nodes.shape, levels), float("-inf"))
        sums[..., : depth + 1] = torch.stack(partial[::-1], dim=2)
        out.append((nodes, torch.where((nodes >= 0)[..., None], sums, float("-inf"))))
    return out
