"""A batch's exclusions as a few dead trie nodes per request (sparse), in place of the dense [B, num_nodes] rows of
``CatalogTrie.dead_nodes``: the same children are blocked (a child is dead iff its (parent, code) is listed), at a
cost that follows the excluded items rather than the catalog's size: built from the items' paths alone, applied as
one [B, m, D] comparison and one scatter per step instead of a [B, m, C] gather over the dense rows.

Shapes: B requests, D dead nodes (the most of any request; padded), m beams, C codebook size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenizer_rqvae.trie import CatalogTrie

PAD = -2  # a padding slot's parent: matches no beam (beams are nodes >= 0, or -1 when dead)


@dataclass(frozen=True)
class SparseDead:
    parent: torch.Tensor  # [B, D] long: each dead node's parent (PAD at padding)
    code: torch.Tensor  # [B, D] long: the code that reaches it from its parent (0 at padding)
    depths: frozenset[int]  # the depths of the dead nodes (a step into any other depth blocks nothing)

    @classmethod
    def of(cls, trie: CatalogTrie, excluded: Sequence[Sequence[int]]) -> SparseDead | None:
        """[B] each request's excluded items -> their dead nodes but the root (nobody's child, so it blocks no
        step); None when no request has one (nothing to block)."""
        dead = [nodes[nodes > 0] for nodes in (trie.dead_of(items) for items in excluded)]
        width = max((len(nodes) for nodes in dead), default=0)
        if width == 0:
            return None
        parent = np.full((len(dead), width), PAD, dtype=np.int64)
        code = np.zeros((len(dead), width), dtype=np.int64)
        depths: set[int] = set()
        for b, nodes in enumerate(dead):
            parent[b, : len(nodes)], code[b, : len(nodes)], depth = trie.dead_edges(nodes)
            depths.update(depth.tolist())
        return cls(torch.from_numpy(parent).to(trie.device), torch.from_numpy(code).to(trie.device),
                   frozenset(depths))

    def into(self, depth: int) -> SparseDead | None:
        """These dead nodes for a step into ``depth`` (the children of depth - 1 beams): None when none is there."""
        return self if depth in self.depths else None

    def alive(self, nodes: torch.Tensor, codebook_size: int) -> torch.Tensor:
        """nodes [B, m] beams (-1 dead) -> [B, m, C] bool: False where the beam's child by that code is dead."""
        b, m = nodes.shape
        hit = nodes[:, :, None] == self.parent[:, None, :]  # [B, m, D] the dead nodes under each beam
        col = torch.where(hit, self.code[:, None, :], codebook_size)  # [B, m, D] their codes, else a spare column
        out = torch.ones(b, m, codebook_size + 1, dtype=torch.bool, device=nodes.device)
        return out.scatter_(2, col, False)[..., :codebook_size]
