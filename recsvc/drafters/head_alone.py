"""The draft head's beams accepted without verification (NEZHA-style decoding): ``head_alone_search``.

Strict and relaxed verification spend target forwards to check the head's drafts. NEZHA (an industrial
generative recommender) serves with one backbone pass and small per-code heads instead: here the target runs once
(the prompt prefill), its own next-code distribution ranks the first code exactly, and the recurrent draft head
(``recsvc.drafters.head``) beam-searches the remaining L - 1 codes, conditioned on the target's hidden state, with
the trie, the request's exclusions and the fused prior applied as the target applies them. The lists are not the
target's: ``recsvc bench speculative --mode head`` measures their quality against plain decoding's (Recall@K,
NDCG@K and the share of identical lists) beside the time it saves.

Shapes: B prompts, K beams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsvc.drafters.head import HeadDrafter, HeadDraftSession
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import to_device
from recsvc.engine.speculation.ports import TargetState
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class HeadAloneOutput:
    leaves: torch.Tensor  # [B, K] trie leaves, best first by the head's beam score (-1: fewer valid items)
    scores: torch.Tensor  # [B, K] the target's first-code log-prob + the head's log-probs (+ the prior's terms)
    target_calls: int  # 1: the prompt prefill
    head_steps: int  # the head's batched steps (L - 1)


@torch.inference_mode()
def head_alone_search(target: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch, width: int,
                      drafter: HeadDrafter, dead: torch.Tensor | None = None, prior: torch.Tensor | None = None
                      ) -> HeadAloneOutput:
    """``width`` beams per prompt: one target forward, then the head's beam search (module docstring). ``dead`` /
    ``prior``: [B, num_nodes] exclusions and the fused prior, as plain decoding takes them."""
    dev = target.device
    trie, prompts = trie.to(dev), prompts.to(dev)
    dead, prior = to_device(dead, dev), to_device(prior, dev)
    cache = TreeCache(target, trie, code_offset, prompts)
    session = HeadDraftSession(drafter.draft_head, trie, dead, prior)
    leaves, scores = session.search_alone(len(prompts.lengths), width, TargetState(target, cache))
    return HeadAloneOutput(leaves, scores, cache.calls, session.head_steps)
