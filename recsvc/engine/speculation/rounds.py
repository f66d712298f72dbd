"""Bookkeeping shared by the strict and relaxed speculative loops: which requests are still running, their
current target beams, and the step that retires finished requests and compacts the caches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.speculation.ports import Session


@dataclass
class ActiveBeams:
    rows: torch.Tensor  # [R] original request index of each unfinished request
    nodes: torch.Tensor  # [R, Kc] the target's current beams (the root at first)
    scores: torch.Tensor  # [R, Kc] their beam scores (strict) or sequence log-probs (relaxed)
    depth: torch.Tensor  # [R] depth of the beams
    per_row: dict[str, torch.Tensor | None] = field(default_factory=dict)  # follow the rows (dead, temperature)

    @classmethod
    def start(cls, batch: int, device: torch.device | str = "cpu", **per_row: torch.Tensor | None) -> ActiveBeams:
        return cls(torch.arange(batch, device=device), torch.zeros(batch, 1, dtype=torch.long, device=device),
                   torch.zeros(batch, 1, device=device), torch.zeros(batch, dtype=torch.long, device=device),
                   dict(per_row))

    def advance(self, go: torch.Tensor, new_nodes: torch.Tensor, new_scores: torch.Tensor) -> None:
        """Rows with ``go`` [R] take the new beams [R, K] and go one depth down."""
        if self.nodes.shape[1] != new_nodes.shape[1]:  # first depth of the batch: every row goes
            self.nodes, self.scores = new_nodes, new_scores
        else:
            self.nodes = torch.where(go[:, None], new_nodes, self.nodes)
            self.scores = torch.where(go[:, None], new_scores, self.scores)
        self.depth += go.long()

    def retire(self, levels: int, cache: TreeCache, drafts: Session
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove finished requests (depth == L) from the batch, the target cache and the drafter; compact the
        KV of the others to their beams' paths. Returns (original rows, nodes, scores) of the finished ones.
        (The sync-free strict loop, ``recsvc.engine.speculation.strict.unrolled``, never retires rows: no read, no
        row copy.)"""
        done = self.depth >= levels
        finished = (self.rows[done], self.nodes[done], self.scores[done])
        keep = torch.nonzero(~done).reshape(-1)  # host sync (a shape): which rows stay is a decision
        if len(keep) < len(self.rows):
            self.rows, self.nodes, self.scores, self.depth = (t[keep] for t in
                                                               (self.rows, self.nodes, self.scores, self.depth))
            self.per_row = {k: (v[keep] if v is not None else None) for k, v in self.per_row.items()}
            cache.select_rows(keep)
            drafts.select_rows(keep)
        if len(self.rows):
            cache.compact(self.nodes)
            drafts.observe(self.nodes)
        return finished
