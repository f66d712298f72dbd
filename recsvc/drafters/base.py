"""The drafter interface: propose draft beams for a batch of requests, observe what the target accepted.

A drafter is created once (``Drafter``); each batch of requests opens a ``DraftSession`` that may keep state
(a KV cache, the retrieval candidates). Drafts are trie nodes: a node is a code prefix, so a drafted beam and
its prefix tree are the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from recsvc.engine.prompts import PromptBatch


class DraftSession(Protocol):
    calls: int  # drafter forward calls so far (0 for training-free drafters)

    def propose(
        self,
        roots: torch.Tensor,  # [B, Kc] the target's current beams (trie nodes of depth j_b; -1 dead)
        root_scores: torch.Tensor,  # [B, Kc] their target scores
        steps: torch.Tensor,  # [B] how many depths to draft per row (0 = none)
        width: int,  # N: draft beams per depth
    ) -> list[torch.Tensor]:  # max(steps) tensors [B, N]: drafted nodes at depth j_b + s (-1 = none)
        ...

    def observe(self, beams: torch.Tensor) -> None:  # [B, K] the target's beams after the round
        ...

    def select_rows(self, rows: torch.Tensor) -> None:  # keep only these requests (others finished)
        ...


class Drafter(Protocol):
    name: str

    def session(
        self,
        prompts: PromptBatch,  # the target's prompts (drafters share the target's tokenizer)
        histories: Sequence[Sequence[int]],  # item ids per request (retrieval drafters use them)
        dead: torch.Tensor | None,  # [B, num_nodes] excluded prefixes per request
        prior: torch.Tensor | None = None,  # [B, num_nodes] the target's fused item prior (recsvc.engine.prior)
    ) -> DraftSession: ...
