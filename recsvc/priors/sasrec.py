"""The SASRec network (Kang & McAuley 2018, "Self-Attentive Sequential Recommendation").

For a history of item rows s_1..s_L (rows 1..n; 0 = padding, at the right end of a batch row):

    x_t = sqrt(d) * E[s_t] + P[t]                         E: [n + 1, d] item table, P: [max_len, d] positions
    h   = LN(Block_N(... Block_1(dropout(x)) ...))        pre-norm causal self-attention + ReLU FFN blocks
    logits_t(j) = <h_t, E[j]>,  j = 1..n                  the item table is shared between input and output

Position t attends to positions <= t only (causal mask), so right padding never leaks into a real position
and no key-padding mask is needed. ``h_t`` predicts s_{t+1}; training puts a full-softmax cross-entropy on
every real position, ranking reads ``h`` at the last real position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SASRec(nn.Module):
    def __init__(self, n_items: int, hidden: int = 64, blocks: int = 2, heads: int = 1, dropout: float = 0.5,
                 max_len: int = 50) -> None:
        super().__init__()
        self.n_items = n_items
        self.hidden = hidden
        self.max_len = max_len
        self.item_emb = nn.Embedding(n_items + 1, hidden, padding_idx=0)  # [n + 1, d], row 0 = padding
        self.pos_emb = nn.Embedding(max_len, hidden)  # [max_len, d]
        self.emb_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=hidden, dropout=dropout, activation="relu",
                                       batch_first=True, norm_first=True)
            for _ in range(blocks)
        )
        self.final_norm = nn.LayerNorm(hidden)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-normal matrices (as the reference implementation), zero padding row."""
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def hidden_states(self, seqs: torch.Tensor) -> torch.Tensor:
        """[B, L] item rows (right-padded with 0, L <= max_len) -> [B, L, d]."""
        length = seqs.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len {self.max_len}")
        pos = torch.arange(length, device=seqs.device)
        x = self.item_emb(seqs) * math.sqrt(self.hidden) + self.pos_emb(pos)  # [B, L, d]
        x = self.emb_dropout(x)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=seqs.device)  # [L, L] 0 / -inf
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.final_norm(x)

    def item_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[P, d] hidden states -> [P, n] scores of item rows 1..n (the padding row is never a candidate)."""
        return h @ self.item_emb.weight[1:].T

    def last_hidden(self, seqs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, L] right-padded rows, [B] lengths (>= 1) -> [B, d] the hidden state at each last real position.
        In eval mode ``_last_hidden_eval`` computes it with few ops (the serving prior and the baseline's
        ranking call this once per request)."""
        if not self.training:
            return self._last_hidden_eval(seqs, lengths)
        h = self.hidden_states(seqs)  # [B, L, d]
        return h[torch.arange(seqs.shape[0], device=seqs.device), lengths - 1]

    def _last_hidden_eval(self, seqs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` at the last real positions, in eval mode (dropout off), as functional ops on the
        blocks' own weights: ``nn.TransformerEncoderLayer`` with an odd head count (SASRec's one head) leaves
        PyTorch's fused fast path and runs ~40 Python-level ops per block (~0.45 ms per block on one CPU core for
        a single history). The last block needs its output at the last real positions only (nothing reads the
        others), so it computes keys / values for every position and the rest for those. Same arithmetic as the
        module path up to float rounding (attention over one query row instead of the causal block; tested)."""
        b, length = seqs.shape
        d = self.hidden
        rows = torch.arange(b, device=seqs.device)
        last = lengths.to(seqs.device) - 1  # [B]
        x = self.item_emb(seqs) * math.sqrt(d) + self.pos_emb.weight[:length]  # [B, L, d]
        for i, block in enumerate(self.blocks):
            attn = block.self_attn
            heads = attn.num_heads
            y = F.layer_norm(x, (d,), block.norm1.weight, block.norm1.bias, block.norm1.eps)
            q, k, v = F.linear(y, attn.in_proj_weight, attn.in_proj_bias).split(d, dim=-1)  # [B, L, d] each
            mask = None
            if i == len(self.blocks) - 1:  # the last block: the last real positions only
                x, q = x[rows, last][:, None], q[rows, last][:, None]  # [B, 1, d]
                mask = (torch.arange(length, device=seqs.device) <= last[:, None])[:, None, None]  # [B, 1, 1, L]
            q, k, v = (t.reshape(b, t.shape[1], heads, d // heads).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # [B, h, ., d/h]
            x = x + F.linear(out.transpose(1, 2).reshape(b, -1, d), attn.out_proj.weight, attn.out_proj.bias)
            y = F.layer_norm(x, (d,), block.norm2.weight, block.norm2.bias, block.norm2.eps)
            x = x + block.linear2(F.relu(block.linear1(y)))
        return self.final_norm(x)[:, 0]  # [B, d]
