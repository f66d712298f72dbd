"""The head drafter: beam search inside the recurrent draft head, rooted at the target's own beams.

A round starts from the target's current beams (depth j) and reads, through ``TargetState``, the target's final
hidden state h at each of them (cached by the previous verification; the first round's root is the prompt's
last token, whose hidden state costs the prompt prefill, counted as a target call). Then:
- depth j + 1: the target's own next-code log-probs at the beams (its LM head on h: exact, no draft error);
- depth j + 2, ...: the head (``head_model.DraftHead``) steps its recurrent state over the code just drafted
  and scores the next level's codes, conditioned on the h of the draft's root beam.
Each depth keeps the top-N beams (``expand_beams``: the trie, the request's exclusions and the fused prior
applied as the target applies them), so the drafted nodes form the tree the engine verifies in one forward.
No transformer forward runs to draft: ``calls`` stays 0; ``head_steps`` counts the head's batched steps.

Shapes: R rows, Kc the target's beams, N draft width, H hidden, S head state, C codes per level.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsvc.drafters.head_model import DraftHead
from recsvc.engine.beam_search import expand_beams
from recsvc.engine.ports import StrictOnly, TargetState
from recsvc.engine.prompts import PromptBatch
from tokenizer_rqvae.trie import CatalogTrie


def _gather(t: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """[R, n, D] rows of the parents [R, N] -> [R, N, D]."""
    return t.gather(1, parent.clamp(min=0)[..., None].expand(-1, -1, t.shape[2]))


class HeadDraftSession:
    calls = 0  # no drafter forward: the head's steps are a few small matmuls

    def __init__(self, head: DraftHead, trie: CatalogTrie, dead: torch.Tensor | None,
                 prior: torch.Tensor | None) -> None:
        self.head, self.trie, self.dead, self.prior = head, trie, dead, prior
        self.head_steps = 0

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, root_scores: torch.Tensor, steps: torch.Tensor, width: int,
                target: TargetState) -> list[torch.Tensor]:
        g = int(steps.max()) if len(steps) else 0
        if g == 0:
            return []
        trie, head = self.trie, self.head
        r, kc = roots.shape
        # a root the target chose at a rejected depth is not cached yet (the next verification feeds it): read
        # its parent's hidden state (cached: the target scored the root from it) and step the head over the
        # root's code instead of spending a target forward on it; the root node itself (first round) costs the
        # prompt prefill, which is a target call
        from_parent = (roots >= 1) & ~target.cached(roots)  # [R, Kc]
        base = torch.where(from_parent, trie.parent[roots.clamp(min=0)], roots)
        h = target.hidden_at(base).to(head.out.dtype)  # [R, Kc, H]
        state = head.start(h.reshape(r * kc, -1))  # [R Kc, S]
        logp = target.logprobs_at(torch.where(from_parent, -1, roots))  # [R, Kc, C]: exact where cached
        if bool(from_parent.any()):
            safe = roots.clamp(min=1)
            stepped, logq = head.step(state, h.reshape(r * kc, -1), (trie.depth[safe] - 1).reshape(-1),
                                      trie.node_code[safe].reshape(-1))
            self.head_steps += 1
            fp = from_parent.reshape(-1, 1)
            state = torch.where(fp, stepped, state)
            logp = torch.where(from_parent[..., None], logq.view(r, kc, -1), logp)
        nodes, scores, parent = expand_beams(trie, roots, root_scores, logp, width, self.dead, prior=self.prior)
        drafts = [torch.where((steps >= 1)[:, None], nodes, -1)]
        if g == 1:
            return drafts
        h = _gather(h, parent)  # [R, N, H] the hidden state each draft's recurrence is conditioned on
        state = _gather(state.view(r, kc, -1), parent)  # [R, N, S]
        n = nodes.shape[1]
        for s in range(2, g + 1):
            alive = nodes >= 1
            safe = torch.where(alive, nodes, 1)
            level = (trie.depth[safe] - 1).clamp(max=trie.levels - 2)  # [R, n] the consumed code's level
            new_state, logq = head.step(state.reshape(r * n, -1), h.reshape(r * n, -1), level.reshape(-1),
                                        trie.node_code[safe].reshape(-1))
            self.head_steps += 1
            logq = torch.where(alive[..., None], logq.view(r, n, -1), float("-inf"))
            nodes, scores, parent = expand_beams(trie, torch.where(alive, nodes, -1), scores, logq, width,
                                                 self.dead, prior=self.prior)
            drafts.append(torch.where((steps >= s)[:, None], nodes, -1))
            n = nodes.shape[1]
            state, h = _gather(new_state.view(r, -1, new_state.shape[-1]), parent), _gather(h, parent)
        return drafts

    def observe(self, beams: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.dead is not None:
            self.dead = self.dead[rows]
        if self.prior is not None:
            self.prior = self.prior[rows]


class HeadDrafter(StrictOnly):
    name = "head"

    def __init__(self, head: DraftHead, trie: CatalogTrie) -> None:
        self.head, self.trie = head, trie

    def session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]],
                dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> HeadDraftSession:
        return HeadDraftSession(self.head, self.trie, dead, prior)
