"""The engine's forward of a LLaMA model as plain tensor ops: transformers' numerics, without its per-call overhead.

A decode step of the `small` target is a few dozen tiny matmuls; in transformers' ``LlamaModel.forward`` the
module hooks, kwargs plumbing, mask construction and cache bookkeeping around them cost as much as the
arithmetic. ``LeanLlama`` runs the same kernels in the same order on the same tensors (RMSNorm in fp32 then
cast, rotary embedding from the model's own module, bf16 elementwise ops rounded where transformers rounds
them), so its hidden states are bit-identical to transformers' (tests compare them), with two changes that do
not alter a single bit:
- q/k/v and gate/up projections are fused into one matmul each (column j of ``x @ W.T`` depends only on row j
  of ``W``; checked by the tests on the real kernels);
- the KV cache is a plain list of tensors (``LeanCache``), appended once per call.

Prefix cache: every prompt starts with the same instruction header. The shared prefix is learned as the
longest common prefix of the prompts seen (it shrinks to the header after two users). Its rows' q/k/v at every
layer depend only on the prefix and on the prompt's length T (the shape of the prefill's attention call), so
they are kept per T (the first prompt of each length computes and stores them) and a prefill then runs the
projections and MLPs on the history rows only, feeding the very same full-length attention call. On Beauty
the header is about half of an average prompt.

Only what the engine needs: inference, models switched to tree attention (``TreeGroups`` give every query its
key set), ``LlamaForCausalLM`` with SiLU MLP and no biases. Anything else (PEFT wrappers, other architectures)
keeps transformers' path. Weights are fused copies, rebuilt when a parameter changes in place (training
between validations bumps the parameters' version counters). One ``LeanLlama`` (and so one prefix cache) per
``recsvc.engine.kernels.engine_model.EngineModel``, which builds and rebuilds it; nothing is stored on the model.

Shapes: B requests, n new tokens, S cached slots, H hidden, h heads, d head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedModel

from recsvc.engine.kernels.attention import TreeGroups, tree_attention
from recsvc.engine.kernels.layer import LayerShape, decoder_layer, exact_rms_norm, layer_weights
from recsvc.engine.kernels.pieces import LeanKV, LeanLinear


class LeanCache:
    """The per-layer KV tensors (the interface ``TreeCache.compact`` / ``select_rows`` use: ``layers[i].keys``)."""

    def __init__(self, lean: LeanLlama) -> None:
        self.layers: list[LeanKV] = []
        self.lean = lean  # the forward (weights version) this cache was started with

    def get_seq_length(self) -> int:
        return int(self.layers[0].keys.shape[2]) if self.layers else 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.layers):
            self.layers.append(LeanKV(k, v))
        else:
            self.layers[layer].append(k, v)
        kv = self.layers[layer]
        return kv.keys, kv.values


class LeanLlama:
    def __init__(self, model: LlamaForCausalLM) -> None:
        decoder = model.get_decoder()
        self.model = model
        self.rotary = decoder.rotary_emb
        self.embed = decoder.embed_tokens.weight
        self.norm, self.norm_eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.shape = LayerShape.of(model)
        self.attn = [layer.self_attn for layer in decoder.layers]  # tree attention reads their GQA settings
        self.layers = [layer_weights(layer, LeanLinear) for layer in decoder.layers]
        self.lm_head = LeanLinear(model.get_output_embeddings().weight)
        # inference tensors (a copy made under ``torch.inference_mode``) have no version counter and never change
        self._params = [p for p in model.parameters() if not p.is_inference()]
        self.built_version = self.version()  # the parameters' version the fused copies were made from
        self._prefix: torch.Tensor | None = None  # [P] the longest common prefix of the prompts seen
        # prompt length T -> per layer (q, k, v) of the shared prefix rows, each [h, P, d] (post-rotary)
        self._prefix_rows: OrderedDict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = OrderedDict()

    def version(self) -> tuple[int, ...]:
        """The parameters' in-place update counters (training bumps them; the fused copies are then stale).
        Inference tensors have none and never change, so they are left out (the check runs per forward and per
        head call)."""
        return tuple(p._version for p in self._params)

    @staticmethod
    def supported(model: PreTrainedModel) -> bool:
        cfg = model.config
        return (type(model) is LlamaForCausalLM and not getattr(cfg, "attention_bias", False)
                and not getattr(cfg, "mlp_bias", False) and getattr(cfg, "hidden_act", "") == "silu"
                and getattr(cfg, "pretraining_tp", 1) == 1)

    @property
    def stale(self) -> bool:
        """A parameter changed in place since the fused copies were made (``EngineModel`` then rebuilds)."""
        return self.built_version != self.version()

    def new_cache(self) -> LeanCache:
        return LeanCache(self)

    def _prefix_plan(self, input_ids: torch.Tensor, tree: TreeGroups) -> tuple[int, list[int]] | None:
        """On a first call (prompts in it): update the shared prefix with these prompts and return (P, the rows'
        prompt lengths), P < every length; None when there are no prompts or the prefix is too short to pay."""
        lengths = list(tree.prompt_lengths)
        if not lengths:
            return None
        limit = min(lengths) - 1  # a prompt's last token is never in the prefix (its hidden state is needed)
        cand = self._prefix if self._prefix is not None else input_ids[0, :limit]
        m = min(len(cand), limit)
        same = (input_ids[:, :m] == cand[:m].to(input_ids.device)).all(0)  # [m]
        p = int(same.long().cumprod(0).sum()) if m else 0
        if p < len(cand):  # the prefix shrank: the stored rows belong to the longer one
            self._prefix_rows.clear()
        self._prefix = cand[:p].clone()
        return (p, lengths) if p >= MIN_PREFIX else None

    @torch.inference_mode()
    def forward(
        self,
        cache: LeanCache,
        input_ids: torch.Tensor,  # [B, n]
        position_ids: torch.Tensor,  # [B, n]
        tree: TreeGroups,
    ) -> torch.Tensor:  # [B, n, H] final hidden states (after the last norm; zeros on a cached prefix's rows)
        plan = self._prefix_plan(input_ids, tree)
        if plan is not None and all(t in self._prefix_rows for t in plan[1]):
            p, lengths = plan
            for t in lengths:
                self._prefix_rows.move_to_end(t)
            rows = [self._prefix_rows[t] for t in lengths]
            out = self._forward(cache, input_ids, position_ids, tree, skip=p, prefix=rows)
            return torch.cat([out.new_zeros(out.shape[0], p, out.shape[2]), out], 1)
        capture = [] if plan is not None else None
        out = self._forward(cache, input_ids, position_ids, tree, capture=capture)
        if plan is not None:
            p, lengths = plan
            for row, t in enumerate(lengths):
                if t not in self._prefix_rows:
                    self._prefix_rows[t] = [(q[row, :, :p].clone(), k[row, :, :p].clone(), v[row, :, :p].clone())
                                            for q, k, v in capture]
            while len(self._prefix_rows) > MAX_PREFIX_LENGTHS:
                self._prefix_rows.popitem(last=False)
        return out

    def _forward(self, cache: LeanCache, input_ids: torch.Tensor, position_ids: torch.Tensor, tree: TreeGroups,
                 skip: int = 0, prefix: Sequence[list[tuple[torch.Tensor, ...]]] | None = None,
                 capture: list[tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor:
        """The layers over tokens ``skip:`` of each row ([B, n - skip, H] out); with ``skip`` > 0 the first
        ``skip`` rows' q/k/v come from ``prefix`` (one per row) and join the attention call unchanged.
        ``capture`` collects every layer's (q, k, v) [B, h, n, d]."""
        b, n = input_ids.shape
        m = n - skip
        hidden = F.embedding(input_ids[:, skip:], self.embed)  # [B, m, H]
        cos, sin = self.rotary(hidden, position_ids)  # [B, n, d] each (the full shape: same values as unskipped)
        cos, sin = cos[:, skip:, None], sin[:, skip:, None]  # [B, m, 1, d]
        for i, w in enumerate(self.layers):

            def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: None, i: int = i
                       ) -> torch.Tensor:  # [B, m, h, d], [B, m, h_kv, d] x 2 -> [B, m, h d]
                q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, heads, m, d]
                if skip:  # the prefix rows' q / k / v join the attention call unchanged
                    q, k, v = (torch.cat([torch.stack([r[i][j] for r in prefix]), t], 2)
                               for j, t in enumerate((q, k, v)))
                if capture is not None:
                    capture.append((q, k, v))
                keys, values = cache.append(i, k, v)
                attn, _ = tree_attention(self.attn[i], q, keys, values, None, scaling=self.shape.scaling, tree=tree)
                return attn[:, skip:].reshape(b, m, -1).contiguous()

            hidden = decoder_layer(self.shape, w, hidden, cos, sin, attend, exact_rms_norm)
        return exact_rms_norm(hidden, self.norm, self.norm_eps)


MAX_PREFIX_LENGTHS = 64  # prompt lengths whose prefix rows are kept (least recently used dropped)
MIN_PREFIX = 8  # shorter shared prefixes are not worth the bookkeeping
