"""The LLaMA drafter: a small causal LM on the target's tokenizer drafts by trie-constrained beam search.

Each round starts from the target's beams (scored with the target's beam scores, the best estimate of their
rank) and runs ``steps`` beam-search steps of width N, keeping every step's beams. Its model is an
``EngineModel`` like the target's (built by ``EngineModel.build``: tree attention, the lean forward and its own
prefix cache) and its KV cache a ``TreeCache``: nodes drafted in one round are reused in the next.

Drafter forwards: drafting depth j + s needs the distributions at the depth j + s - 1 frontier, so a round of
g depths costs at most g forwards (the first round's first one is the prompt prefill); the last drafted
depth's nodes are never fed (the next round feeds those that became target beams); ``observe`` keeps what was
drafted under the target's new beams, so no node is fed twice; rows with fewer steps add no tokens, and a
depth with nothing new to feed makes no call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsvc.drafters.rows import sampled_depth, take_rows
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.expand import expand_beams
from recsvc.engine.search.beam_search import node_logprobs, to_device
from recsvc.engine.search.noise import NoiseStream
from recsvc.engine.search.sampling import tempered_logp
from recsvc.engine.speculation.ports import DraftStep, TargetState
from tokenizer_rqvae.trie import CatalogTrie


class LlamaDraftSession:
    def __init__(self, model: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch,
                 dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> None:
        dev = model.device  # the session's tensors follow its model (moved once, here)
        self.model, self.trie, self.dead = model, trie.to(dev), to_device(dead, dev)
        self.prior = to_device(prior, dev)  # [B, num_nodes] the target's fused prior: draft the fused beams
        self.cache = TreeCache(model, trie, code_offset, prompts)

    closed_tree = True  # every drafted node's parent is a root or a node drafted one depth above (beam search)

    @property
    def calls(self) -> int:
        return self.cache.calls

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, root_scores: torch.Tensor, steps: torch.Tensor, width: int,
                target: TargetState, depths: int | None = None) -> list[torch.Tensor]:
        """``DraftSession.propose`` (``target`` unused: the drafter runs its own model)."""
        nodes, scores = roots, root_scores
        drafts: list[torch.Tensor] = []
        for s in range(1, (depths if depths is not None else int(steps.max())) + 1):
            active = (steps >= s)[:, None]  # [B, 1]
            nodes = torch.where(active, nodes, torch.full_like(nodes, -1))
            self.cache.feed(nodes, bound=None if s == 1 else nodes.shape[1])  # depth s > 1: parents fed at s - 1
            logp = node_logprobs(self.model, self.cache, nodes)  # [B, n, C]
            nodes, scores, _ = expand_beams(self.trie, nodes, scores, logp, width, self.dead, prior=self.prior)
            drafts.append(torch.where(active, nodes, torch.full_like(nodes, -1)))
        return drafts

    @torch.inference_mode()
    def sample(self, roots: torch.Tensor, root_logp: torch.Tensor, steps: torch.Tensor, width: int,
               temperature: torch.Tensor, gens: Sequence[torch.Generator] | NoiseStream, target: TargetState,
               depths: int | None = None) -> list[DraftStep]:
        """Relaxed mode: sample ``width`` sequences per depth without replacement from the drafter's tempered,
        trie-masked distribution over the children of its previous depth's samples (starting from the target's
        beams, weighted by their target log-probs). ``depths``: that many depths, nothing read
        (``SamplingSession.sample``)."""
        nodes, weights = roots, root_logp
        b = roots.shape[0]
        most = steps.max()
        out: list[DraftStep] = []
        for s in range(1, (depths if depths is not None else int(most)) + 1):
            active = (steps >= s)[:, None]
            nodes = torch.where(active, nodes, torch.full_like(nodes, -1))
            self.cache.feed(nodes)
            logq, child = tempered_logp(self.model, self.cache, nodes, temperature, self.dead,
                                        self.prior)  # [B, n, C]
            step, new_nodes, new_w = sampled_depth(nodes, weights, logq, child, active, width, gens,
                                                    (most >= s).expand(b))
            out.append(step)
            nodes, weights = new_nodes, new_w
        return out

    def observe(self, beams: torch.Tensor) -> None:
        self.cache.compact(beams, descendants=True)  # what it drafted under the new beams serves the next round

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)
        self.dead, self.prior = take_rows(self.dead, rows), take_rows(self.prior, rows)


class LlamaDrafter:
    name = "llama"
    samples = True
    draft_head = None

    def __init__(self, model: EngineModel, trie: CatalogTrie, code_offset: int) -> None:
        """``model``: ``EngineModel.build(drafter_model, attention)``."""
        self.model, self.trie, self.code_offset = model, trie, code_offset

    def over(self, trie: CatalogTrie) -> LlamaDrafter:
        return LlamaDrafter(self.model, trie, self.code_offset)

    def session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]],
                dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> LlamaDraftSession:
        return LlamaDraftSession(self.model, self.trie, self.code_offset, prompts, dead, prior)

    def sampling_session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]],
                         dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> LlamaDraftSession:
        return self.session(prompts, histories, dead, prior)
