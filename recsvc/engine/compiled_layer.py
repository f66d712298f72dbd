"""One decoder layer of the fast forward as a ``torch.compile`` graph, for the bucketed / CUDA-graph forwards
(``EngineModel(forward="compiled-graphs")``).

Why: with every forward replayed from a CUDA graph (``recsvc.engine.cuda_graphs``), the host no longer launches
anything, but the device still runs each op of a layer as its own kernel: RMSNorm, the fused q/k/v matmul, the
rotary expression (five elementwise kernels), two cache writes, the float32 casts around attention, attention,
the o-projection, the residual add, RMSNorm, the gate/up matmul, SiLU, the product, the down matmul, the residual
add: about 25 kernels per layer, 300 per forward of the 12-layer ``base`` target. At a batch of one request each
is a few microseconds of mostly idle GPU, so a forward costs ~1.5 ms on an H100 where its weights stream in
~0.1 ms. Inductor fuses the elementwise work into a few generated kernels around the matmuls and attention
(triton on CUDA, C++ loops on a CPU); the CUDA graph then replays the fused kernels.

The function is compiled once per model with every size dynamic (requests B, new tokens q, cache width S), so
the buckets share a few graphs (dynamo specialises sizes 0 and 1 apart) rather than compiling one per bucket;
all layers of a model share the compiled code (their weights are arguments). The bucketed forward's warm-up
runs each bucket twice before capturing it, so compilation and kernel tuning happen before any capture.

Numerics: the same operations as ``FastLlama.run_layers``; inductor's fused loops round in their own order
(bf16: the tolerance the fast forward documents). The last layer of a prompt prefill (``keep``) stays eager.

Shapes: B requests, q new tokens, S cache width, H hidden, h heads, h_kv kv heads, d head dim, I intermediate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recsvc.engine.fast import _rotary, attention


@dataclass(frozen=True)
class LayerShape:
    """What the compiled code specialises on (constants of the graph, not arguments)."""

    hidden: int  # H
    heads: int  # h
    kv_heads: int  # h_kv
    head_dim: int  # d
    intermediate: int  # I
    scaling: float
    eps1: float
    eps2: float


def layer_function(shape: LayerShape) -> Callable[..., torch.Tensor]:
    """The decoder layer of ``FastLlama.run_layers`` (no ``keep``) as a plain function of its tensors."""
    h, hkv, d, inter = shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    nqk, nv, half, gqa = (h + hkv) * d, hkv * d, d // 2, h != hkv
    norm_shape = (shape.hidden,)

    def layer(
        hidden: torch.Tensor,  # [B, q, H]
        cos: torch.Tensor,  # [B, q, 1, d]
        sin: torch.Tensor,  # [B, q, 1, d]
        slots: torch.Tensor,  # [B, q] where the new keys / values go
        mask: torch.Tensor,  # [B, 1, q, S] bool
        keys: torch.Tensor,  # [B, h_kv, S, d] written in place
        values: torch.Tensor,  # [B, h_kv, S, d] written in place
        n1: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor,  # [H], [(h + 2 h_kv) d, H], [H, h d]
        n2: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,  # [H], [2 I, H], [H, I]
    ) -> torch.Tensor:  # [B, q, H]
        b, q = hidden.shape[0], hidden.shape[1]
        rows = torch.arange(b, device=hidden.device)[:, None].expand(b, q)
        out = F.linear(F.rms_norm(hidden, norm_shape, n1, shape.eps1), qkv)  # [B, q, (h + 2 h_kv) d]
        qk = _rotary(out[..., :nqk].view(b, q, h + hkv, d), cos, sin, half)
        keys.transpose(1, 2)[rows, slots] = qk[:, :, h:]
        values.transpose(1, 2)[rows, slots] = out[..., nqk:nqk + nv].view(b, q, hkv, d)
        query = qk[:, :, :h].transpose(1, 2)  # [B, h, q, d]
        attn = attention(query, keys, values, mask, shape.scaling, gqa)  # [B, h, q, d]
        hidden = hidden + F.linear(attn.transpose(1, 2).reshape(b, q, h * d), o)
        gu = F.linear(F.rms_norm(hidden, norm_shape, n2, shape.eps2), gate_up)  # [B, q, 2 I]
        return hidden + F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], down)

    return layer


class CompiledLayer:
    """``layer_function`` under ``torch.compile`` (dynamic sizes, one graph, no CUDA graphs of its own: the
    bucketed forward captures). ``failed`` holds the reason when compilation failed: the caller then runs its
    eager loop (``FastLlama.run_layers``), so a machine without a working compiler still serves."""

    def __init__(self, shape: LayerShape) -> None:
        self.shape = shape
        self.fn = torch.compile(layer_function(shape), dynamic=True, fullgraph=True)
        self.failed = ""
        self.calls = 0

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | None:
        """The layer's output, or None when compilation failed (now or before)."""
        if self.failed:
            return None
        try:
            out = self.fn(*args)
        except Exception as exc:  # a missing toolchain / an unsupported op: recorded, the eager loop serves
            self.failed = f"{type(exc).__name__}: {str(exc)[:300]}"
            return None
        self.calls += 1
        return out
