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
``recsvc.engine.engine_model.EngineModel``, which builds and rebuilds it; nothing is stored on the model.

Shapes: B requests, n new tokens, S cached slots, H hidden, h heads, d head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedModel

from recsvc.engine.attention import TreeGroups, tree_attention
from recsvc.engine.layer import LayerShape, decoder_layer, exact_rms_norm, layer_weights


class _KV:
    """One layer's keys and values, stored token-major ([B, S, h_kv, d] contiguous) and seen as transformers'
    [B, h_kv, S, d]: gathering a token's key slots (exact tree attention) is then a plain row gather, with no
    transposing copy of the whole cache per layer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    @property
    def keys(self) -> torch.Tensor:  # [B, h_kv, S, d] (a view)
        return self._k.transpose(1, 2)

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:
        self._k = value.transpose(1, 2).contiguous()

    @property
    def values(self) -> torch.Tensor:
        return self._v.transpose(1, 2)

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        self._v = value.transpose(1, 2).contiguous()

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # [B, h_kv, n, d] each
        self._k = torch.cat([self._k, k.transpose(1, 2)], 1)
        self._v = torch.cat([self._v, v.transpose(1, 2)], 1)


class LeanCache:
    """The per-layer KV tensors (the interface ``TreeCache.compact`` / ``select_rows`` use: ``layers[i].keys``)."""

    def __init__(self, lean: LeanLlama) -> None:
        self.layers: list[_KV] = []
        self.lean = lean  # the forward (weights version) this cache was started with

    def get_seq_length(self) -> int:
        return int(self.layers[0].keys.shape[2]) if self.layers else 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.layers):
            self.layers.append(_KV(k, v))
        else:
            self.layers[layer].append(k, v)
        kv = self.layers[layer]
        return kv.keys, kv.values


class _Linear:
    """``F.linear(x, weight)`` (no bias); on CPU in bf16 with the weight pre-packed for oneDNN once, instead of
    at every call, when a probe shows the packed kernel returns the very bits ``F.linear`` returns."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight: torch.Tensor | None = weight.detach()
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)
                gen = torch.Generator().manual_seed(0)
                probe = [torch.randn(m, weight.shape[1], generator=gen).to(weight.dtype) for m in (1, 10, 37, 130)]
                if all(torch.equal(self._packed(x, packed), F.linear(x, self.weight)) for x in probe):
                    self.packed = packed
                    self.weight = None  # the packed copy is all it needs
            except (RuntimeError, AttributeError):  # a build without these ops: plain F.linear
                self.packed = None

    @staticmethod
    def _packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight)
        shape = x.shape
        return self._packed(x.reshape(-1, shape[-1]), self.packed).view(*shape[:-1], -1)


class LeanLlama:
    def __init__(self, model: LlamaForCausalLM) -> None:
        decoder = model.get_decoder()
        self.model = model
        self.rotary = decoder.rotary_emb
        self.embed = decoder.embed_tokens.weight
        self.norm, self.norm_eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.shape = LayerShape.of(model)
        self.attn = [layer.self_attn for layer in decoder.layers]  # tree attention reads their GQA settings
        self.layers = [layer_weights(layer, _Linear) for layer in decoder.layers]
        self.lm_head = _Linear(model.get_output_embeddings().weight)
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
