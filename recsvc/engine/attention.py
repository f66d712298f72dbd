"""Tree attention with exact numerics: every generated token attends exactly its own keys, in order.

A token of depth d in request b attends ``[prompt slots of b, its ancestors' slots (depth order), itself]``:
the very keys, in the very order, that a beam of transformers' ``generate`` holds in its own cache row. The
engine gathers those keys per token and runs SDPA on them with no mask, grouping tokens of one (request,
depth) into one call (they share the key count). Consequences, checked by the tests and the benchmarks:
- a node's hidden state does not depend on what else is in the forward (the other beams, a draft tree of any
  shape, the prompt of the first round), so strict speculative decoding reproduces plain beam search and the
  engine reproduces ``generate`` bit for bit in bf16 (bf16 linear layers on CPU are row-independent);
- each prompt's own queries (first call only) run causal SDPA over that prompt alone, unpadded.
Without a ``tree`` argument the function is transformers' SDPA, so training and ``generate`` are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

TREE_ATTENTION = "recsvc_tree"


ATTENTION_MODES = ("exact", "fp32")


@dataclass(frozen=True)
class TreeGroups:
    """How the queries of one forward attend (shared by all layers).

    prompt_lengths: the first call's prompts (row b's tokens are queries and keys 0..len-1, causal; padding
    queries get zeros); empty on later calls. groups: (rows [g], query indices [g], key slots [g, S]) for tree
    tokens with S keys each (tokens of any requests that share a key count run in one SDPA call: SDPA's result
    for one query does not depend on the others in the batch). upcast: run the tree tokens' attention in fp32
    ("fp32" mode: bf16 SDPA with one query per row is several times slower on CPUs than fp32)."""

    prompt_lengths: list[int]
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    upcast: bool = False


def tree_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   tree: TreeGroups | None = None, **kwargs):
    """query [B, h, q, d], key/value [B, h_kv, S, d] -> ([B, q, h, d], None), like sdpa_attention_forward."""
    if tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, q, d = query.shape
    out = query.new_zeros(b, q, h, d)
    for row, n in enumerate(tree.prompt_lengths):  # each prompt alone, causal, unpadded: as generate's prefill
        o, _ = sdpa_attention_forward(module, query[row : row + 1, :, :n], key[row : row + 1, :, :n],
                                      value[row : row + 1, :, :n], None, dropout=0.0, scaling=scaling)
        out[row, :n] = o[0]
    for rows, qidx, slots in tree.groups:
        qg = query[rows, :, qidx][:, :, None]  # [g, h, 1, d]
        kg = key[rows[:, None], :, slots].transpose(1, 2)  # [g, h_kv, S, d]
        vg = value[rows[:, None], :, slots].transpose(1, 2)
        if tree.upcast:
            qg, kg, vg = qg.float(), kg.float(), vg.float()
        o, _ = sdpa_attention_forward(module, qg, kg, vg, None, dropout=0.0, scaling=scaling)  # [g, 1, h, d]
        out[rows, qidx] = o[:, 0].to(out.dtype)
    return out, None


AttentionInterface.register(TREE_ATTENTION, tree_attention)
AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)


def use_tree_attention(model, mode: str = "exact") -> None:
    """Switch a loaded model to tree attention (SDPA whenever no tree is given: training, generate).

    mode "exact": bf16 SDPA exactly as transformers runs it (the engine reproduces ``generate`` bit for bit);
    "fp32": the generated tokens' attention in fp32 (faster on CPUs; strict speculative decoding still
    reproduces plain beam search bit for bit, since both use the same per-token computation)."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
    model.recsvc_attention = mode
    model.config._attn_implementation = TREE_ATTENTION
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) not in (None, TREE_ATTENTION):
            cfg._attn_implementation = TREE_ATTENTION
