"""One decoder layer of the fast forward as a ``torch.compile`` graph, for the bucketed / CUDA-graph forwards
(``EngineModel(forward="compiled-graphs")``).

Why: with every forward replayed from a CUDA graph (``recsvc.engine.kernels.cuda_graphs``), the host no longer launches
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

Numerics: the one decoder layer (``recsvc.engine.kernels.layer.slot_layer``) compiled; inductor's fused loops round in
their own order (bf16: the tolerance the fast forward documents). The last layer of a prompt prefill (``keep``)
stays eager.

Shapes: B requests, q new tokens, S cache width, H hidden, h heads, h_kv kv heads, d head dim, I intermediate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from recsvc.engine.kernels.layer import LayerShape, LayerWeights, slot_layer, weight_of

if TYPE_CHECKING:
    from recsvc.engine.kernels.fast import FastLlama


def layer_function(shape: LayerShape, eps1: float, eps2: float):
    """``recsvc.engine.kernels.layer.slot_layer`` (no ``keep``) as a plain function of its tensors, the weights included
    (all layers share it; the norms' epsilons are constants of the graph)."""

    def layer(
        hidden: torch.Tensor,  # [B, q, H]
        cos: torch.Tensor,  # [B, q, 1, d]
        sin: torch.Tensor,  # [B, q, 1, d]
        slots: torch.Tensor,  # [B, q] where the new keys / values go
        visible: torch.Tensor,  # [B, q, S] bool
        keys: torch.Tensor,  # [B, h_kv, S, d] written in place
        values: torch.Tensor,  # [B, h_kv, S, d] written in place
        n1: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor,  # [H], [(h + 2 h_kv) d, H], [H, h d]
        n2: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,  # [H], [2 I, H], [H, I]
    ) -> torch.Tensor:  # [B, q, H]
        w = LayerWeights(n1, eps1, qkv, o, n2, eps2, gate_up, down)
        return slot_layer(shape, w, hidden, cos, sin, slots, visible, keys, values)

    return layer


class CompiledLayer:
    """``layer_function`` under ``torch.compile`` (dynamic sizes, one graph, no CUDA graphs of its own: the
    bucketed forward captures). ``failed`` holds the reason when compilation failed: the caller then runs the
    eager layer, so a machine without a working compiler still serves."""

    def __init__(self, shape: LayerShape, eps1: float, eps2: float) -> None:
        self.shape = shape
        self.fn = torch.compile(layer_function(shape, eps1, eps2), dynamic=True, fullgraph=True)
        self.failed = ""
        self.calls = 0

    def __call__(self, w: LayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, visible: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
                 ) -> torch.Tensor | None:
        """The layer's output, or None when compilation failed (now or before)."""
        if self.failed:
            return None
        try:
            out = self.fn(hidden, cos, sin, slots, visible, keys, values, w.norm1, weight_of(w.qkv), weight_of(w.o),
                          w.norm2, weight_of(w.gate_up), weight_of(w.down))
        except Exception as exc:  # a missing toolchain / an unsupported op: recorded, the eager layer serves
            self.failed = f"{type(exc).__name__}: {str(exc)[:300]}"
            return None
        self.calls += 1
        return out


def compiled_layer(fast: FastLlama) -> CompiledLayer | None:
    """The compile-each-layer strategy for ``fast`` (``FastLlama``'s ``compile_layer``): one compiled layer
    function for all its layers, or None when their norms' epsilons differ."""
    eps = {(float(w.eps1), float(w.eps2)) for w in fast.layers}
    if len(eps) != 1:
        return None
    e1, e2 = eps.pop()
    return CompiledLayer(fast.shape, e1, e2)
