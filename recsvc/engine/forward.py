"""One primitive for every target/drafter call: a forward over new tokens with an explicit attention pattern.

Plain beam search, the drafter and the speculative verifier all feed tokens that attend to an arbitrary set of
cached slots (the prompt, their ancestors in a beam/draft tree) and to themselves. Expressing all of them with
one call ``tree_forward(model, cache, ids, positions, attend)`` keeps their numerics consistent, and the KV
cache never has to be copied per beam: beams of one request share one cache row, and a beam's tokens are
masked to see only their own ancestors.

Shapes: B requests, q new tokens per request, S_past cached slots, H hidden size.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from recsvc.engine.attention import TREE_ATTENTION, TreeGroups
from recsvc.engine.lean import LeanCache, LeanLlama


def new_cache(model: PreTrainedModel) -> DynamicCache | LeanCache:
    """A LeanCache (the lean forward) for models switched to tree attention that it supports, else transformers'."""
    if getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION:
        lean = LeanLlama.for_model(model)
        if lean is not None:
            return lean.new_cache()
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache | LeanCache) -> int:
    return int(cache.get_seq_length())


@torch.inference_mode()
def tree_forward(
    model: PreTrainedModel,
    cache: DynamicCache | LeanCache,
    input_ids: torch.Tensor,  # [B, q] token ids (padding: any valid id, masked)
    position_ids: torch.Tensor,  # [B, q] rotary positions (prompt length + depth for tree tokens)
    attend: torch.Tensor,  # [B, q, S_past + q] bool: True where the new token may attend the slot (unused with tree)
    tree: TreeGroups | None = None,  # exact per-token key sets (models switched to tree attention)
) -> torch.Tensor:  # [B, q, H] final hidden states (after the last norm)
    if isinstance(cache, LeanCache):
        assert tree is not None, "the lean forward needs the tree's key sets"
        return cache.lean.forward(cache, input_ids, position_ids, tree)
    s_past = cache_length(cache)
    b, q = input_ids.shape
    assert tree is not None or attend.shape == (b, q, s_past + q), f"attend {tuple(attend.shape)}"
    dtype = model.dtype
    # additive mask: 0 where allowed, dtype-min elsewhere (a fully masked padding row stays finite)
    mask = torch.zeros(attend.shape, dtype=dtype, device=input_ids.device)
    mask.masked_fill_(~attend, torch.finfo(dtype).min)
    out = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=mask[:, None],  # [B, 1, q, S]
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        tree=tree,
    )
    return out.last_hidden_state


def code_logprobs(
    model: PreTrainedModel,
    hidden: torch.Tensor,  # [M, H]
    level: torch.Tensor,  # [M] code level (0..L-1) whose tokens each row scores
    code_offset: int,
    codebook_size: int,
) -> torch.Tensor:  # [M, C] float32 log-probabilities of the level's code tokens
    """transformers' beam-score convention: log_softmax over the FULL vocabulary in float32, then the slice of
    the level's code tokens (tokens outside the trie are masked by the caller, without renormalising).

    The LM head runs only on the rows that need a next-token distribution, never on the prompt."""
    lean = LeanLlama.current(model)
    head = lean.lm_head if lean is not None else model.get_output_embeddings()
    logits = head(hidden).float()  # [M, V]
    cols = code_offset + level[:, None] * codebook_size + torch.arange(codebook_size, device=hidden.device)
    return torch.log_softmax(logits, dim=-1).gather(1, cols)
