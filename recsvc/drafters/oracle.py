"""The oracle drafter proposes the target's own beams (from a plain beam search run beforehand).

It measures the engine's ceiling on the hardware: every draft is accepted, so the speculative engine spends
one target call per request and the remaining cost is the tree forward itself. Its own cost is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.ports import StrictOnly, TargetState
from tokenizer_rqvae.trie import CatalogTrie


class OracleDraftSession:
    calls = 0
    closed_tree = False  # its drafts need not hold their parents (the verification reads the tree's size)

    def __init__(self, beams: list[torch.Tensor], node_depth: torch.Tensor) -> None:
        self.beams = torch.stack(beams, 1)  # [B, L, K]: the target's beams after depth 1..L
        self.node_depth = node_depth  # [num_nodes] trie depth of each node

    def propose(self, roots: torch.Tensor, root_scores: torch.Tensor, steps: torch.Tensor, width: int,
                target: TargetState, depths: int | None = None) -> list[torch.Tensor]:
        b, levels, beams = self.beams.shape
        depth = self.node_depth[roots.max(dim=1).values.clamp(min=0)]  # [B] all roots of a row share a depth
        out = []
        for s in range(1, (depths if depths is not None else int(steps.max())) + 1):
            d = (depth + s - 1).clamp(max=levels - 1)  # beams of depth j + s
            rows = self.beams[torch.arange(b, device=d.device), d][:, :width]  # [B, min(N, K)]
            if width > beams:
                rows = torch.cat([rows, torch.full((b, width - beams), -1, dtype=rows.dtype, device=rows.device)], 1)
            out.append(torch.where((steps >= s)[:, None], rows, torch.full_like(rows, -1)))
        return out

    def observe(self, beams: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        self.beams = self.beams[rows]


class OracleDrafter(StrictOnly):
    name = "oracle"
    model = None  # it runs the target (its cost is not counted)
    draft_head = None

    def __init__(self, engine: BeamSearch, width: int) -> None:
        self.engine, self.width = engine, width  # the target's beam search it replays

    def over(self, trie: CatalogTrie) -> OracleDrafter:
        return OracleDrafter(BeamSearch(self.engine.model, trie, self.engine.code_offset), self.width)

    def session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]],
                dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> OracleDraftSession:
        out = self.engine.search(prompts, self.width, dead, prior)  # the fused beams when a prior is fused
        return OracleDraftSession(out.beams, self.engine.trie.depth)
