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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
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
    # "fp32" mode: per request, (row, query indices [n], ancestor slots [n, L] (-1 pad), prompt length T_b);
    # the prompt occupies slots 0..T_b-1 of the row
    split: list[tuple[int, torch.Tensor, torch.Tensor, int]] | None = None
    # exact mode: per (group, cache width), its key slots as rows of the flattened [B * S] cache; computed by the
    # first layer, reused by the others
    _flat: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def flat_keys(self, i: int, width: int) -> torch.Tensor:
        """[g * S] rows (request * width + slot) of group i's key slots in a [B * width] flattened cache."""
        got = self._flat.get((i, width))
        if got is None:
            rows, _, slots = self.groups[i]
            got = self._flat[(i, width)] = (rows[:, None] * width + slots).reshape(-1)
        return got


def tree_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   tree: TreeGroups | None = None, **kwargs):
    """query [B, h, q, d], key/value [B, h_kv, S, d] -> ([B, q, h, d], None), like sdpa_attention_forward."""
    if tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, q, d = query.shape
    out = query.new_zeros(b, q, h, d)
    # each prompt causal and unpadded, as generate's prefill; prompts of one length share a call (SDPA's result
    # for one sequence does not depend on the others in the batch)
    by_length: dict[int, list[int]] = {}
    for row, n in enumerate(tree.prompt_lengths):
        by_length.setdefault(n, []).append(row)
    for n, rows in by_length.items():
        idx = torch.tensor(rows, device=query.device)
        o, _ = sdpa_attention_forward(module, query[idx, :, :n], key[idx, :, :n], value[idx, :, :n], None,
                                      dropout=0.0, scaling=scaling)
        out[idx, :n] = o
    if tree.split is not None:
        _split_attention(module, query, key, value, scaling, tree.split, out)
        return out, None
    if tree.groups:
        s_all, h_kv = key.shape[2], key.shape[1]
        if tree.upcast:  # once per layer, not once per gathered copy
            query, key, value = query.float(), key.float(), value.float()
        flat_k = key.transpose(1, 2).reshape(b * s_all, h_kv, d)  # [B*S, h_kv, d] rows = (request, slot)
        flat_v = value.transpose(1, 2).reshape(b * s_all, h_kv, d)  # (free views of a token-major cache)
        direct = getattr(module, "num_key_value_groups", 1) == 1
    whole = not tree.prompt_lengths and len(tree.groups) == 1 and len(tree.groups[0][0]) == b * q
    for i, (rows, qidx, slots) in enumerate(tree.groups):
        g, n_keys = slots.shape
        qg = query[rows, :, qidx][:, :, None]  # [g, h, 1, d]
        idx = tree.flat_keys(i, s_all)  # [g * S]
        kg = flat_k.index_select(0, idx).view(g, n_keys, h_kv, d).transpose(1, 2)  # [g, h_kv, S, d]
        vg = flat_v.index_select(0, idx).view(g, n_keys, h_kv, d).transpose(1, 2)
        if direct:  # what sdpa_attention_forward runs for one query without GQA, minus its bookkeeping
            o = F.scaled_dot_product_attention(qg, kg, vg, dropout_p=0.0, scale=scaling).transpose(1, 2)
        else:
            o, _ = sdpa_attention_forward(module, qg, kg, vg, None, dropout=0.0, scaling=scaling)  # [g, 1, h, d]
        if whole:  # one group holding every query, in row-major order (nonzero's): no scatter
            return o[:, 0].to(out.dtype).view(b, q, h, d), None
        out[rows, qidx] = o[:, 0].to(out.dtype)
    return out, None


def _split_attention(module, query, key, value, scaling, split, out) -> None:
    """fp32 mode: the generated tokens' attention = the shared prompt part (one flash-attention call over the
    prompt's keys, which also returns each query's log-sum-exp) merged with the tiny ancestor part (<= L keys
    per token): no per-token copy of the prompt's keys. Requests with the same prompt length and token count
    share one call. out: [B, q, h, d] (filled in place)."""
    groups = getattr(module, "num_key_value_groups", 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    batches: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for row, qidx, anc, n_prompt in split:
        batches.setdefault((n_prompt, len(qidx)), []).append((row, qidx, anc))
    for (n_prompt, _), items in batches.items():
        rows = torch.tensor([r for r, _, _ in items], device=query.device)  # [g]
        qidx = torch.stack([q for _, q, _ in items])  # [g, n]
        anc = torch.stack([a for _, _, a in items])  # [g, n, L]
        q = query[rows[:, None], :, qidx].transpose(1, 2).float()  # [g, h, n, d]
        k, v = key[rows].float(), value[rows].float()  # [g, h_kv, S, d]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        if q.is_cuda:
            from torch.nn.functional import scaled_dot_product_attention as sdpa

            lse_p = torch.logsumexp(torch.einsum("ghnd,ghsd->ghns", q, k[:, :, :n_prompt]) * scale, -1)
            out_p = sdpa(q, k[:, :, :n_prompt], v[:, :, :n_prompt], scale=scale)
        else:
            out_p, lse_p, *_ = flash(q, k[:, :, :n_prompt], v[:, :, :n_prompt], 0.0, False, attn_mask=None,
                                     scale=scale)  # [g, h, n, d], [g, h, n]
        g_idx = torch.arange(len(items), device=query.device)[:, None, None]
        ka = k[g_idx, :, anc.clamp(min=0)].permute(0, 3, 1, 2, 4)  # [g, h, n, L, d]
        va = v[g_idx, :, anc.clamp(min=0)].permute(0, 3, 1, 2, 4)
        sa = (q[:, :, :, None, :] * ka).sum(-1) * scale  # [g, h, n, L]
        sa = sa.masked_fill((anc < 0)[:, None], float("-inf"))
        lse_a = torch.logsumexp(sa, -1)  # [g, h, n]
        out_a = (torch.softmax(sa, -1)[..., None] * va).sum(-2)  # [g, h, n, d]
        lse = torch.logaddexp(lse_p, lse_a)
        merged = (lse_p - lse).exp()[..., None] * out_p + (lse_a - lse).exp()[..., None] * out_a
        out[rows[:, None], qidx] = merged.transpose(1, 2).to(out.dtype)  # [g, n, h, d]


AttentionInterface.register(TREE_ATTENTION, tree_attention)
AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)


def use_tree_attention(model) -> None:
    """Switch a loaded model's attention implementation to tree attention (SDPA whenever no tree is given:
    training, generate). Only the config changes; the engine's attention mode ("exact" / "fp32", see
    ``ATTENTION_MODES``) is held by ``recsvc.engine.kernels.engine_model.EngineModel``, the only caller:

    mode "exact": each generated token's own keys gathered and run through bf16 SDPA exactly as transformers
    does (the engine reproduces ``generate`` bit for bit; strict == plain bit for bit);
    "fp32": the generated tokens' attention in fp32, split into the prompt part (shared by all of a request's
    tokens, never copied) and the ancestors part, merged by log-sum-exp (several times faster on CPUs in
    batches; strict speculative decoding equals plain beam search up to fp32 rounding)."""
    model.config._attn_implementation = TREE_ATTENTION
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) not in (None, TREE_ATTENTION):
            cfg._attn_implementation = TREE_ATTENTION
