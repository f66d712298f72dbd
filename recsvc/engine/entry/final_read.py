"""A decoded batch read to the host in one device-to-host transfer: ``read_decoded``.

A request's lists leave the device once, at its end: the leaves and scores of the first ``top`` beams of every
row (and, for the dense head, the prompts' final hidden states) go to the host as one float64 vector (leaf ids
< 2**53 and float32 / bf16 values are exact in float64), and everything after that (which beams are valid,
their items, the head's query) is host work. Reading row by row (a boolean mask, a ``tolist`` per row) would
wait for the device once per read (``recsvc.engine.meters.host_reads``).

    >>> import torch
    >>> from recsvc.engine.entry.dispatch import Decoded
    >>> from recsvc.engine.entry.modes import Decoding
    >>> out = Decoded(torch.tensor([[5, -1]]), torch.tensor([[-0.5, float("-inf")]]), [1], [0], 0,
    ...               Decoding("plain", 2))
    >>> read_decoded(out, 2).row(0)
    ([5], [-0.5])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsvc.engine.entry.dispatch import Decoded
from recsvc.engine.meters.host_reads import uncounted


@dataclass(frozen=True)
class HostDecoded:
    leaves: list[list[int]]  # [B][top] each row's leaves, best first (-1: no valid beam)
    scores: list[list[float]]  # [B][top] their scores
    prompt_hidden: torch.Tensor | None  # [B, H] on the host, in the decoding's dtype (None unless asked for)

    def row(self, r: int, k: int | None = None) -> tuple[list[int], list[float]]:
        """Row ``r``'s valid leaves among its first ``k`` beams (default: all read), and their scores."""
        pairs = [(leaf, s) for leaf, s in zip(self.leaves[r][:k], self.scores[r][:k], strict=True) if leaf >= 0]
        return [leaf for leaf, _ in pairs], [s for _, s in pairs]


def read_decoded(out: Decoded, top: int | None = None, hidden: bool = False) -> HostDecoded:
    """``out``'s first ``top`` (default: all) leaves and scores of every row and, with ``hidden``, its prompts'
    final hidden states, read in ONE device-to-host transfer."""
    leaves, scores = out.leaves, out.scores
    if top is not None:
        leaves, scores = leaves[:, :top], scores[:, :top]
    b, w = leaves.shape
    parts = [leaves.reshape(-1).double(), scores.reshape(-1).double()]
    if hidden:
        assert out.prompt_hidden is not None
        parts.append(out.prompt_hidden.reshape(-1).double())
    flat = torch.cat(parts).cpu()  # the one read
    with uncounted():  # host tensors from here on (on a CPU run, too)
        lv = flat[: b * w].view(b, w).long().tolist()
        sc = flat[b * w : 2 * b * w].view(b, w).tolist()
        host_hidden = None
        if hidden:
            assert out.prompt_hidden is not None
            host_hidden = flat[2 * b * w :].view(out.prompt_hidden.shape).to(out.prompt_hidden.dtype)
    return HostDecoded(lv, sc, host_hidden)
