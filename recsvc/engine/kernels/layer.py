"""The LLaMA decoder layer, written once: every engine forward runs it (all but transformers' own, the reference).

A layer is RMSNorm -> fused q/k/v projection -> rotary (q and k in one go) -> attention -> o projection ->
residual -> RMSNorm -> fused gate/up projection -> SiLU(gate) * up -> down projection -> residual.
``decoder_layer`` computes that over one call's new tokens; what differs between the forwards is a strategy
it is handed, never a copy of the layer:
- **attention** (``Attend``): where the new keys / values go and which keys each query sees. The lean forward
  (``recsvc.engine.kernels.lean``) appends to a growing cache and runs tree attention over exact key sets
  (``recsvc.engine.kernels.attention``: transformers' kernels, bit for bit); the fast forward and everything built on it
  (``recsvc.engine.kernels.fast``, the bucketed / CUDA-graph forwards) write them into slots of preallocated buffers and
  run one masked SDPA per layer (``slot_layer``, a plain function of tensors);
- **the norm**: transformers' op-by-op RMSNorm (``exact_rms_norm``: the lean forward's bits) or ``F.rms_norm``
  (``slot_layer``; the same bits in fp32);
- **the projections**: a weight tensor (``F.linear``) or a pre-packed oneDNN linear (any callable).
Compiling is a strategy applied to ``slot_layer`` (``recsvc.engine.kernels.compiled_layer``: torch.compile of the
one layer; ``recsvc.engine.kernels.compiled_stack``: inductor over the stack of them), capturing one applied to a
whole forward (``recsvc.engine.kernels.cuda_graphs``); the forward plan (``recsvc.engine.kernels.plan``) says which
apply.

``keep`` (a prompt prefill that needs only some tokens' outputs): keys / values of every token, then q,
attention, o and the MLP for the kept tokens only (``LayerWeights.q`` / ``.kv``: the fused projection's columns
apart).

Shapes: B requests, q new tokens, r kept tokens, S key slots, H hidden, h heads, h_kv kv heads, d head dim,
I intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

Linear = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # a weight [out, in] or a packed linear
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x [..., H], weight [H], eps) -> [..., H]


@dataclass(frozen=True)
class LayerShape:
    """The sizes a layer is built for (constants of a compiled graph, not arguments)."""

    hidden: int  # H
    heads: int  # h
    kv_heads: int  # h_kv
    head_dim: int  # d
    intermediate: int  # I
    scaling: float  # attention's softmax scale
    # fewer kv heads than heads (grouped-query attention): a bool of its own, since under
    # ``torch.compile(dynamic=True)`` the ints read inside the graph are symbolic and SDPA takes a plain bool
    gqa: bool

    @classmethod
    def of(cls, model: torch.nn.Module) -> LayerShape:
        """From a transformers ``LlamaForCausalLM`` (its config and its attention modules' scale)."""
        cfg, layers = model.config, model.get_decoder().layers
        heads = int(cfg.num_attention_heads)
        d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        kv_heads = int(cfg.num_key_value_heads)
        return cls(int(cfg.hidden_size), heads, kv_heads, d, int(cfg.intermediate_size),
                   float(layers[0].self_attn.scaling) if len(layers) else 1.0, heads != kv_heads)


class LayerWeights(NamedTuple):
    """One layer's weights: norms [H] with their epsilons, fused projections (``Linear``)."""

    norm1: torch.Tensor  # [H]
    eps1: float
    qkv: Linear  # [(h + 2 h_kv) d, H]: [q | k | v]
    o: Linear  # [H, h d]
    norm2: torch.Tensor  # [H]
    eps2: float
    gate_up: Linear  # [2 I, H]: [gate | up]
    down: Linear  # [H, I]
    q: Linear | None = None  # [h d, H] the q columns apart (``keep``)
    kv: Linear | None = None  # [2 h_kv d, H] the k / v columns apart (``keep``)


def layer_weights(layer: torch.nn.Module, linear: Callable[[torch.Tensor], Linear], split: bool = False
                  ) -> LayerWeights:
    """A transformers ``LlamaDecoderLayer``'s weights, fused, each projection made by ``linear`` (a packing, or
    the tensor itself); ``split``: also q and k / v apart (the layer that serves ``keep``)."""
    a, m = layer.self_attn, layer.mlp
    with torch.no_grad():
        return LayerWeights(
            layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon),
            linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
            linear(a.o_proj.weight),
            layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon),
            linear(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
            linear(m.down_proj.weight),
            linear(a.q_proj.weight) if split else None,
            linear(torch.cat([a.k_proj.weight, a.v_proj.weight])) if split else None)


class Attend(Protocol):
    def __call__(
        self,
        query: torch.Tensor,  # [B, q', h, d] rotated (q' = r with ``keep``)
        key: torch.Tensor,  # [B, q, h_kv, d] rotated: the new tokens' keys, to store
        value: torch.Tensor,  # [B, q, h_kv, d]
        keep: torch.Tensor | None,  # [B, r] or None
    ) -> torch.Tensor:  # [B, q', h d] the attention output of the queries
        ...


def decoder_layer(shape: LayerShape, w: LayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Attend, norm: Norm, keep: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [B, q, H], cos / sin [B, q, 1, d] -> [B, q, H] ([B, r, H] with ``keep``)."""
    b, q = hidden.shape[0], hidden.shape[1]
    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    nqk, nv = (h + hkv) * d, hkv * d
    x = norm(hidden, w.norm1, w.eps1)
    if keep is None:
        out = linear(x, w.qkv)  # [B, q, (h + 2 h_kv) d]
        qk = rotary(out[..., :nqk].view(b, q, h + hkv, d), cos, sin)  # q and k in one go
        query, key = qk[:, :, :h], qk[:, :, h:]
        value = out[..., nqk:nqk + nv].view(b, q, hkv, d)
    else:  # k / v of every token; the rest for the kept ones
        assert w.q is not None and w.kv is not None, "keep needs the layer's q and k / v projections apart"
        r = keep.shape[1]
        out = linear(x, w.kv)  # [B, q, 2 h_kv d]
        key = rotary(out[..., :nv].view(b, q, hkv, d), cos, sin)
        value = out[..., nv:].view(b, q, hkv, d)
        pick = keep[..., None]  # [B, r, 1]
        hidden = hidden.gather(1, pick.expand(b, r, hidden.shape[2]))  # [B, r, H]
        rows = linear(x.gather(1, pick.expand(b, r, x.shape[2])), w.q).view(b, r, h, d)
        query = rotary(rows, cos.gather(1, pick[..., None].expand(b, r, 1, d)),
                       sin.gather(1, pick[..., None].expand(b, r, 1, d)))
    hidden = hidden + linear(attend(query, key, value, keep), w.o)  # a new tensor: the input's intact
    gu = linear(norm(hidden, w.norm2, w.eps2), w.gate_up)  # [B, q, 2 I]
    inter = shape.intermediate
    return hidden + linear(F.silu(gu[..., :inter]) * gu[..., inter:], w.down)


def slot_layer(shape: LayerShape, w: LayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slots: torch.Tensor, visible: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               keep: torch.Tensor | None = None) -> torch.Tensor:
    """The fast forward's layer, a function of tensors (what the compile strategies compile): each new token's
    key / value written into ``keys`` / ``values`` [B, h_kv, C, d] at its slot (``slots`` [B, q]), attention over
    the first S slots under ``visible`` [B, q, S] (one masked SDPA, float32 arithmetic), ``F.rms_norm``."""
    b, q = hidden.shape[0], hidden.shape[1]
    width = visible.shape[2]

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None
               ) -> torch.Tensor:
        rows = torch.arange(b, device=key.device)[:, None].expand(b, q)
        keys.transpose(1, 2)[rows, slots] = key  # [B, q, h_kv, d] into their slots
        values.transpose(1, 2)[rows, slots] = value
        mask = visible if keep is None else visible.gather(1, keep[..., None].expand(b, keep.shape[1], width))
        out = attention(query.transpose(1, 2), keys[:, :, :width], values[:, :, :width], mask[:, None],
                        shape.scaling, shape.gqa)  # [B, h, q', d]
        return out.transpose(1, 2).reshape(b, query.shape[1], -1)

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # one kernel (fp32: exact's bits)
        return F.rms_norm(x, (shape.hidden,), weight, eps)

    return decoder_layer(shape, w, hidden, cos, sin, attend, norm, keep)


def weight_of(w: Linear) -> torch.Tensor:
    """A projection's weight tensor (a packed linear keeps it beside its packed copy: ``.weight``)."""
    if isinstance(w, torch.Tensor):
        return w
    weight = getattr(w, "weight", None)
    assert isinstance(weight, torch.Tensor), "this linear keeps no weight tensor"
    return weight


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """``F.linear(x, w)`` for a weight tensor, ``w(x)`` for a packed linear."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding, elementwise (q and k rotated together or apart give the same bits);
    x [B, q, heads, d], cos / sin [B, q, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (its bits in every dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
              gqa: bool) -> torch.Tensor:
    """Masked attention in float32 whatever the model's dtype (a bf16 model's softmax and weighted sums then
    round once, as the lean path's "fp32" attention mode does); query [B, h, q, d], keys / values
    [B, h_kv, S, d], mask [B, 1, q, S] -> [B, h, q, d] in the query's dtype."""
    if query.dtype == torch.float32:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), attn_mask=mask, scale=scale,
                                         enable_gqa=gqa)
    return out.to(query.dtype)
