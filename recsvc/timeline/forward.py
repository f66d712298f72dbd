"""The timeline's and the code decoder's forward at serving time, op by op over the stacks' own weights: the same
LLaMA computation as transformers' ``LlamaModel.forward`` (RMSNorm, q/k/v, rotary, causal attention, o, the
SwiGLU MLP, the final norm) without its per-call masks, caches and output objects, which cost more than the math
on the decoder's few positions (tests/test_timeline_search.py checks it equals transformers' forward).

Shapes: N rows, T positions, H hidden, h heads, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class RotaryTables:
    """One stack's rotary cos / sin ([1, T, d] each) by length, dtype and device: constants of the stack (its
    ``inv_freq``), so computed by ``stack.rotary_emb`` at the first forward of each length and kept, not once per
    forward. The model holds one per stack; made outside inference mode, so autograd may read them too."""

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, stack: LlamaModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, T, H] -> (cos [1, T, d], sin [1, T, d]) in x's dtype, equal to ``stack.rotary_emb``'s."""
        inv_freq = stack.rotary_emb.inv_freq
        key = (x.shape[1], x.dtype, x.device, inv_freq.dtype, inv_freq.device)
        table = self._tables.get(key)
        if table is None:
            with torch.inference_mode(False), torch.no_grad():
                table = stack.rotary_emb(x, torch.arange(x.shape[1], device=x.device)[None])
            self._tables[key] = table
        return table


def causal_forward(stack: LlamaModel, x: torch.Tensor, rotary: RotaryTables | None = None) -> torch.Tensor:
    """x [N, T, H] input embeddings -> [N, T, H] the stack's last hidden states (causal, positions 0..T-1).
    ``rotary``: the stack's kept cos / sin (None: computed for this call)."""
    n, t, _ = x.shape
    if rotary is not None:
        cos, sin = rotary.of(stack, x)  # [1, T, d]
    else:
        cos, sin = stack.rotary_emb(x, torch.arange(t, device=x.device)[None])  # [1, T, d]
    for layer in stack.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = (proj(h).view(n, t, -1, attn.head_dim).transpose(1, 2)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))  # [N, h, T, d]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)  # [N, h, T, d]
        x = x + attn.o_proj(o.transpose(1, 2).reshape(n, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return stack.norm(x)
