"""The fast forward's transformer layers as one compiled graph (``torch.compile``, inductor's CPU backend).

``recsvc.engine.fast.FastLlama`` already runs a fixed, small number of ops per layer; what remains of a
forward's fixed cost is the dispatch of those ops (~14 per layer, each a Python call into an ATen kernel) and
the elementwise passes between the matmuls (RMSNorm, rotary, SiLU * up, the residual adds), each reading and
writing its tensor once more. ``CompiledLayers`` is the same layer stack as a ``torch.nn.Module`` that
``torch.compile`` turns into one graph: inductor fuses the elementwise work into a few C++ loops around the
matmuls and runs the graph from one call, with the weights frozen into it (``freezing``: constants, linear
weights pre-packed for oneDNN). Shapes are dynamic (prompt lengths, beam counts and cache widths vary per
call), so a handful of graphs cover every request: one for the prompt prefill (``keep`` given) and one for the
decode / verify forwards, each once per batch size of 1 vs more and 1 token vs more (dynamo specialises those).

Cost: the first call of each kind compiles (10-25 s each on one CPU core; ``recsvc serve --forward compiled``
pays it at start-up in ``BundleRecommender.warm_up``: 46 s for the Beauty target) and the compiler needs a C++
toolchain (``g++``). CPU, fp32 only: elsewhere ``EngineModel`` keeps the uncompiled fast forward.

Numerics: the same arithmetic as ``FastLlama.forward``; inductor's fused loops and its packed matmuls sum in
their own order, so bits differ from the uncompiled path by float rounding, the tolerance the fast path already
documents (tested: the same items as the fast forward with scores within 1e-4, strict speculation == plain beam
search, and the user-state cache's outputs identical with and without it).

Shapes: B requests, q new tokens, S cache width after the call, C cache capacity, H hidden, h heads,
h_kv kv heads, d head dim, I intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from transformers import LlamaForCausalLM

from recsvc.engine.fast import _rotary


def compile_module(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``module`` through ``torch.compile``: inductor, dynamic shapes, the weights frozen into the graph and a C++
    wrapper (the graph's kernels are launched from compiled code, not from Python: on the `small` target this
    took a 1-token forward from ~2.1 to ~1.4 ms). Inductor reads these switches when a graph is compiled, at a
    call's first sight of a new kind of input (the ``options`` argument of ``torch.compile`` does not reach the
    freezing pass), so every call runs under them."""
    graph = torch.compile(module, dynamic=True)

    def run(*args: Any) -> torch.Tensor:
        with inductor_config.patch(freezing=True, cpp_wrapper=True):
            return graph(*args)

    return run


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


class CompiledLayers(torch.nn.Module):
    """LLaMA decoder layers + the final norm over a caller-owned KV cache (``recsvc.engine.fast.FastCache``'s
    buffers), as ``FastLlama.forward`` computes them (compiled by ``compile_module``)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        decoder = model.get_decoder()
        cfg = model.config
        self.h, self.hkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.inter = int(cfg.intermediate_size)
        self.hidden = int(cfg.hidden_size)
        self.scaling = float(decoder.layers[0].self_attn.scaling) if decoder.layers else 1.0
        self.eps = [float(layer.input_layernorm.variance_epsilon) for layer in decoder.layers]
        self.eps2 = [float(layer.post_attention_layernorm.variance_epsilon) for layer in decoder.layers]
        self.norm_eps = float(decoder.norm.variance_epsilon)
        self.n1 = torch.nn.ParameterList([_frozen(la.input_layernorm.weight) for la in decoder.layers])
        self.n2 = torch.nn.ParameterList([_frozen(la.post_attention_layernorm.weight) for la in decoder.layers])
        self.qkv = torch.nn.ParameterList([_frozen(torch.cat([la.self_attn.q_proj.weight, la.self_attn.k_proj.weight,
                                                              la.self_attn.v_proj.weight])) for la in decoder.layers])
        self.o = torch.nn.ParameterList([_frozen(la.self_attn.o_proj.weight) for la in decoder.layers])
        self.gate_up = torch.nn.ParameterList([_frozen(torch.cat([la.mlp.gate_proj.weight, la.mlp.up_proj.weight]))
                                               for la in decoder.layers])
        self.down = torch.nn.ParameterList([_frozen(la.mlp.down_proj.weight) for la in decoder.layers])
        self.norm = _frozen(decoder.norm.weight)
        self.eval()

    def forward(
        self,
        hidden: torch.Tensor,  # [B, q, H] the new tokens' embeddings
        cos: torch.Tensor,  # [B, q, 1, d]
        sin: torch.Tensor,  # [B, q, 1, d]
        visible: torch.Tensor,  # [B, q, S] bool
        slots: torch.Tensor,  # [B, q] cache slots the tokens' keys / values go to
        keys: list[torch.Tensor],  # per layer [B, h_kv, C, d] (C >= S), written in place
        values: list[torch.Tensor],  # per layer [B, h_kv, C, d]
        keep: torch.Tensor | None = None,  # [B, r] the tokens whose outputs are wanted (the last layer's pruning)
    ) -> torch.Tensor:  # [B, q, H] (or [B, r, H] with ``keep``) after the final norm
        b, q, _ = hidden.shape
        h, hkv, d, half = self.h, self.hkv, self.d, self.d // 2
        nq, nv = h * d, hkv * d
        width = visible.shape[2]
        rows = torch.arange(b, device=hidden.device)[:, None].expand(b, q)
        mask = visible[:, None]  # [B, 1, q, S]
        last = len(self.qkv) - 1
        for i in range(len(self.qkv)):
            x = F.rms_norm(hidden, (self.hidden,), self.n1[i], self.eps[i])
            out = F.linear(x, self.qkv[i])  # [B, q, (h + 2 h_kv) d]
            k = _rotary(out[..., nq:nq + nv].view(b, q, hkv, d), cos, sin, half)
            keys[i].transpose(1, 2)[rows, slots] = k
            values[i].transpose(1, 2)[rows, slots] = out[..., nq + nv:].view(b, q, hkv, d)
            query = _rotary(out[..., :nq].view(b, q, h, d), cos, sin, half)  # [B, q, h, d]
            if i == last and keep is not None:  # q, attention, o and the MLP for the kept tokens only
                r = keep.shape[1]
                hidden = hidden.gather(1, keep[..., None].expand(b, r, hidden.shape[2]))  # [B, r, H]
                query = query.gather(1, keep[..., None, None].expand(b, r, h, d))
                mask = visible.gather(1, keep[..., None].expand(b, r, width))[:, None]  # [B, 1, r, S]
                q = r
            attn = F.scaled_dot_product_attention(query.transpose(1, 2), keys[i][:, :, :width],
                                                  values[i][:, :, :width], attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=h != hkv)  # [B, h, q, d]
            hidden = hidden + F.linear(attn.transpose(1, 2).reshape(b, q, nq), self.o[i])
            gu = F.linear(F.rms_norm(hidden, (self.hidden,), self.n2[i], self.eps2[i]), self.gate_up[i])
            hidden = hidden + F.linear(F.silu(gu[..., :self.inter]) * gu[..., self.inter:], self.down[i])
        return F.rms_norm(hidden, (self.hidden,), self.norm, self.norm_eps)
