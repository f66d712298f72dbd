"""The item-level target: a timeline over items plus a small code decoder (docs/ARCHITECTURE.md "The item-level
target"; published form: MARIUS, and RPG "Generating Long Semantic IDs in Parallel for Recommendation").

A history item is ONE input position. Its input is the sum of its codes' embeddings, one table per level,
``e_i = sum_l E_l[c_{i,l}]`` (optionally plus a learnt per-item embedding, zero for items the model never saw,
and a projection of the item's text embedding, which gives items nobody bought an input of their own). A causal
LLaMA-style stack over item positions (rotary over the item index) gives the timeline state h_t at each position.

A small causal code decoder reads ``[proj(h_t), D_1[c_1], .., D_{L-1}[c_{L-1}]]`` and predicts the next item's
codes c_1..c_L, one output head per level. An item's score is the sum of its L code log-probs, each normalised
over the level's whole codebook (the token target's convention: full log_softmax, codes outside the trie are not
renormalised away), in training, in the search and in the tests alike.

Shapes: B users, T item positions, L levels, C codes per level, H hidden, N decoder rows, l <= L decoder steps.
Padding is on the right: causal attention means a real position never sees a pad, so no mask is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaModel

from recsvc.errors import UserError
from recsvc.timeline.config import CONFIG_FILE, WEIGHTS_FILE, TimelineConfig
from recsvc.timeline.forward import RotaryTables, causal_forward


def _llama(hidden: int, layers: int, heads: int, ffn: int, positions: int) -> LlamaModel:
    """A LLaMA stack read through ``inputs_embeds`` (its token table is one unused row)."""
    cfg = LlamaConfig(vocab_size=1, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=ffn, max_position_embeddings=positions,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa",
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaModel(cfg)


class TimelineModel(nn.Module):
    """The timeline (items -> states) and the code decoder (state + code prefix -> next code's log-probs)."""

    def __init__(self, config: TimelineConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.code_in = nn.Embedding(c.levels * c.codebook_size, c.hidden)  # E_l, the timeline's item inputs
        self.item_in = nn.Embedding(c.num_items, c.hidden) if c.num_items else None  # row 0: unseen items
        self.text_in = nn.Linear(c.text_dim, c.hidden, bias=False) if c.text_dim else None
        self.timeline = _llama(c.hidden, c.layers, c.heads, c.ffn, c.max_items)
        self.state_out = nn.Linear(c.hidden, c.hidden)  # proj(h_t): the decoder's first position
        self.code_prev = nn.Embedding(c.levels * c.codebook_size, c.hidden)  # D_l, the decoder's code inputs
        self.decoder = _llama(c.hidden, c.decoder_layers, c.heads, c.ffn, c.levels)
        self.heads = nn.Parameter(torch.empty(c.levels, c.codebook_size, c.hidden))  # one output head per level
        self.drop = nn.Dropout(c.dropout)
        self.lean = True  # evaluation runs ``causal_forward`` (False: transformers' forward, the reference)
        self.timeline_rotary, self.decoder_rotary = RotaryTables(), RotaryTables()  # each stack's kept cos / sin
        # [L] level l's first row in the code tables (E_l, D_l): a constant, not a per-call arange (not saved)
        self.register_buffer("code_offsets", torch.arange(c.levels) * c.codebook_size, persistent=False)
        nn.init.normal_(self.heads, std=c.hidden ** -0.5)
        for emb in (self.code_in, self.code_prev, self.item_in):
            if emb is not None:
                nn.init.normal_(emb.weight, std=0.02)
        if self.item_in is not None:
            with torch.no_grad():
                self.item_in.weight[0].zero_()

    # ---- the timeline --------------------------------------------------------------------------------------
    def item_inputs(self, codes: torch.Tensor, rows: torch.Tensor | None = None,
                    text: torch.Tensor | None = None) -> torch.Tensor:
        """codes [B, T, L] (-1: padding) -> [B, T, H] item inputs (0 at padding). ``rows`` [B, T]: per-item table
        rows (0: none); ``text`` [B, T, text_dim]: the items' text embeddings."""
        pad = codes[..., 0] < 0
        x = self.code_in(codes.clamp(min=0) + self.code_offsets).sum(-2)
        if self.item_in is not None and rows is not None:
            x = x + self.item_in(rows)
        if self.text_in is not None and text is not None:
            x = x + self.text_in(text)
        return x.masked_fill(pad[..., None], 0.0)

    def states(self, codes: torch.Tensor, rows: torch.Tensor | None = None,
               text: torch.Tensor | None = None) -> torch.Tensor:
        """codes [B, T, L] right-padded -> [B, T, H] timeline states h_t (h_t has read items 0..t)."""
        x = self.drop(self.item_inputs(codes, rows, text))
        return self._stack(self.timeline, self.timeline_rotary, x)

    def _stack(self, stack: LlamaModel, rotary: RotaryTables, x: torch.Tensor) -> torch.Tensor:
        """[N, T, H] -> [N, T, H]: transformers' forward while training (autograd, its kernels), the op-by-op
        forward otherwise (``recsvc.timeline.forward``: the same computation without the per-call overhead, over
        the stack's kept rotary tables)."""
        if self.training or not self.lean:
            return stack(inputs_embeds=x, use_cache=False).last_hidden_state
        return causal_forward(stack, x, rotary)

    # ---- the code decoder ----------------------------------------------------------------------------------
    def decoder_first(self, state: torch.Tensor) -> torch.Tensor:
        """state [N, H] -> [N, 1, H] the decoder's first input, proj(h_t): the same at every step of a search."""
        return self.state_out(self.drop(state))[:, None]

    def decoder_inputs(self, state: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """state [N, H], prefix [N, l] codes of levels 1..l -> [N, l + 1, H] the decoder's inputs."""
        return self._after_first(self.decoder_first(state), prefix)

    def _after_first(self, first: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """first [N, 1, H], prefix [N, l] -> [N, l + 1, H]: the first input, then the prefix codes' D_l rows."""
        if prefix.shape[1] == 0:
            return first
        return torch.cat([first, self.code_prev(prefix + self.code_offsets[: prefix.shape[1]])], 1)

    def code_logits(self, state: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """state [N, H], prefix [N, l] (l < L) -> [N, l + 1, C] logits of the codes of levels 1..l+1 (position j
        predicts level j + 1, having read the prefix's first j codes)."""
        out = self._stack(self.decoder, self.decoder_rotary, self.decoder_inputs(state, prefix))
        heads = self.heads[: out.shape[1]]  # [l + 1, C, H]
        return torch.einsum("nph,pch->npc", out, heads)

    def next_code_logprobs(self, first: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """first [N, 1, H] (``decoder_first`` of the rows' states, kept across a search's steps), prefix [N, l] ->
        [N, C] float32 log-probs of level l + 1's code (over the whole codebook): the last position's head only."""
        out = self._stack(self.decoder, self.decoder_rotary, self._after_first(first, prefix))[:, -1]  # [N, H]
        return torch.log_softmax((out @ self.heads[prefix.shape[1]].T).float(), -1)

    def path_code_logprobs(self, state: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """state [N, H], codes [N, L] full paths -> [N, L] float32 log-prob of each level's code given the ones
        before it."""
        logp = torch.log_softmax(self.code_logits(state, codes[:, :-1]).float(), -1)  # [N, L, C]
        return logp.gather(2, codes[..., None]).squeeze(-1)

    def path_logprobs(self, state: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """state [N, H], codes [N, L] full paths -> [N] float32 sum of the L code log-probs (the exhaustive score)."""
        return self.path_code_logprobs(state, codes).sum(-1)

    # ---- files ---------------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps(self.config.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> TimelineModel:
        """The model saved by :meth:`save` (safetensors only), in eval mode; a missing or mismatched file is a
        :class:`UserError`."""
        src = Path(directory)
        if not (src / CONFIG_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
            raise UserError(f"no item-level target in {src} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
        model = cls(TimelineConfig.from_json(json.loads((src / CONFIG_FILE).read_text())))
        missing, unexpected = model.load_state_dict(load_file(str(src / WEIGHTS_FILE)), strict=False)
        if missing or unexpected:
            raise UserError(f"{src / WEIGHTS_FILE}: missing {missing[:3]}, unexpected {unexpected[:3]}")
        return model.eval()
