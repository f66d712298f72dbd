"""The engine's fast forward of a LLaMA model: few ops per layer, a preallocated KV cache, one mask per call.

Where ``recsvc.engine.kernels.lean`` reproduces transformers' numerics bit for bit (it calls the very same kernels, in
the same grouping: one SDPA call per (request, depth) group of tree tokens), this forward trades bit-identity
with ``generate`` for a small, fixed number of ops per layer (profiled on the `small` target, one CPU thread: a
1-token decode forward of the lean path took ~3.5 ms of which ~0.9 ms matmuls; here the matmuls, whose
weights stream from memory once per forward, are ~70% of a forward). Used for fp32 and bf16 models on a CPU
in the "fp32" attention mode (``EngineModel`` picks it; the "exact" mode keeps the lean path):
- every query's key set is ONE boolean mask ``visible [B, q, S]`` built once per forward by the caller
  (``BeamCache`` / ``TreeCache``: prompt slots, ancestors, itself) and shared by all layers; attention is one
  ``scaled_dot_product_attention`` call per layer over the whole cache row with that mask;
- the KV cache (``FastCache``) is preallocated per layer ([B, h_kv, capacity, d], grown by doubling) and new
  tokens are written into their slots in place (no concatenation of the whole cache per call); the slots are
  the caller's, per row, so a batch may mix requests whose prompts are partly in the cache already (the user
  state cache, ``recsvc.engine.caches.state_cache``);
- q and k rotated in one go (one rotary expression over the fused q/k columns);
- a prompt prefill asks for the hidden state of each prompt's last token only (``keep``): the last layer then
  computes keys / values for every token and q, attention, o-projection and MLP for the kept tokens only;
- linear layers on CPU (fp32 and bf16) run oneDNN with the weight pre-packed once, when a probe shows its
  result for a row does not depend on the other rows of the call (so a node's hidden state does not depend on
  what shares its forward, and a cached prompt gives the very bits of a recomputed one); otherwise
  ``F.linear``;
- attention runs in float32 for a bf16 model too (``attention``: q, k, v upcast, the output rounded once), as
  the lean path's "fp32" attention mode does;
- the layer is ``recsvc.engine.kernels.layer.slot_layer`` (the one decoder layer, with slot writes and masked SDPA
  as its attention); a compile strategy (the forward plan's ``compile``) runs the stack as one inductor graph
  (``recsvc.engine.kernels.compiled_stack``) or each layer as a torch.compile graph
  (``recsvc.engine.kernels.compiled_layer``); the embedding, rotary lookup and cache bookkeeping stay here;
- its pieces (the packed linears, a layer's keys / values) are ``recsvc.engine.kernels.pieces``'.
Tolerance: rotary and the MLP are op for op transformers' (cos / sin read from a table of the rotary module's
own rows), RMSNorm is ``F.rms_norm`` (fp32: the same bits as transformers' op-by-op norm); the packed matmuls
and the masked attention sum in another order than ``generate``, so hidden states differ by float rounding
(~1e-6 relative in fp32). Tests hold the fast path to: the same items in the same order as ``generate`` (no
near-ties in the test models) and beam scores within 1e-4; strict speculation == plain beam search (same items,
scores within 1e-4). ``EngineModel(forward="lean")`` keeps the bit-identical path.
bf16: activations round at ~3 significant digits, so near-ties between items reorder whichever path runs (on
the Beauty target, in a one-off check, the lean bf16 path and the fp32 model return the same top-10 in the
same order for 73 of 100 users, the same set for 96, the same first item for all). The fast bf16 forward is
held to that: on the
items both return, its scores are the lean bf16 path's within 0.25 (test models), and it agrees with the fp32
model as often as the lean bf16 path does (Beauty: 72 / 96 / 100 of 100).

Shapes: B requests, q new tokens, S cache width (slots), H hidden, h heads, h_kv kv heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from recsvc.engine.kernels.layer import LayerShape, LayerWeights, layer_weights, slot_layer
from recsvc.engine.kernels.pieces import GROW, FastKV, FastLinear

# a compiled layer: (weights, hidden, cos, sin, slots, visible, keys, values) -> [B, q, H], or None (not compiled)
LayerRunner = Callable[[LayerWeights, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor, torch.Tensor], torch.Tensor | None]

class FastCache:
    """Per-layer keys / values in preallocated buffers [B, h_kv, capacity, d]; ``width`` slots are in use (the
    same for every row; a row's unused slots are never visible). ``layers[i].keys`` / ``.values`` read and
    replace the used part (what ``TreeCache.compact`` / ``select_rows`` use)."""

    def __init__(self, fast: FastLlama, batch: int) -> None:
        self.fast = fast
        self.batch = batch
        self.layers: list[FastKV] = []

    @property
    def width(self) -> int:
        return self.layers[0].n if self.layers else 0

    def get_seq_length(self) -> int:
        return self.width

    def reserve(self, width: int, batch: int) -> None:
        """Make room for ``width`` slots (creating the buffers on first use)."""
        f = self.fast
        if not self.layers:
            self.batch = batch
            cap = max(width, 1) + GROW
            shape = (batch, f.kv_heads, cap, f.head_dim)
            self.layers = [FastKV(self, torch.zeros(shape, dtype=f.dtype, device=f.device),
                               torch.zeros(shape, dtype=f.dtype, device=f.device)) for _ in f.layers]
        for layer in self.layers:
            layer.reserve(width)

    def load_rows(self, row: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy cached prompt rows into slots 0..n-1 of request ``row``: per layer (k, v) [h_kv, n, d]."""
        for kv, (k, v) in zip(self.layers, layers, strict=True):
            n = k.shape[1]
            kv.k[row, :, :n] = k
            kv.v[row, :, :n] = v

    def rows_of(self, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of slots 0..n-1 of request ``row``: per layer (k, v) [h_kv, n, d]."""
        return [(kv.k[row, :, :n].clone(), kv.v[row, :, :n].clone()) for kv in self.layers]


class FastLlama:
    def __init__(self, model: LlamaForCausalLM,
                 compile_layers: Callable[[FastLlama], Callable[..., torch.Tensor]] | None = None,
                 compile_layer: Callable[[FastLlama], LayerRunner | None] | None = None) -> None:
        """The decoder layers are ``recsvc.engine.kernels.layer.slot_layer`` over this forward's fused weights; a
        compile strategy (``recsvc.engine.kernels.plan.ForwardPlan.compile``) changes how they run, never what they
        compute: ``compile_layers`` builds the whole stack as one compiled callable
        (``recsvc.engine.kernels.compiled_stack``), run instead of the loop below; ``compile_layer`` builds one compiled
        runner of the layer shared by every layer (``recsvc.engine.kernels.compiled_layer``: the bucketed / CUDA-graph
        forwards' "compiled-graphs"). (The LM head stays eager: compiled, its log-softmax over the vocabulary measured
        slower than ATen's.)"""
        decoder = model.get_decoder()
        cfg = model.config
        self.shape = LayerShape.of(model)
        self.rotary = decoder.rotary_emb
        self.embed = decoder.embed_tokens.weight
        self.norm, self.norm_eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.heads, self.kv_heads, self.head_dim = self.shape.heads, self.shape.kv_heads, self.shape.head_dim
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.intermediate = self.shape.intermediate
        # the last layer's projections also apart, for a prompt prefill that needs only some rows' outputs
        # (``keep``): k / v of every row, q of the kept rows (the columns of the fused [q | k | v] call; tests
        # compare the kept rows with the full forward's)
        last = len(decoder.layers) - 1
        self.layers = [layer_weights(layer, FastLinear, split=i == last) for i, layer in enumerate(decoder.layers)]
        self.scaling = self.shape.scaling
        self.lm_head = FastLinear(model.get_output_embeddings().weight)
        self.hidden_shape = (self.shape.hidden,)
        self.rotary_table = _rotary_table(self.rotary, cfg, self.embed)
        self.compiled_layers = compile_layers(self) if compile_layers is not None else None
        self.compiled_layer = compile_layer(self) if compile_layer is not None and decoder.layers else None

    @property
    def last_q(self) -> FastLinear | None:
        """The last layer's q projection apart (``keep``)."""
        return self.layers[-1].q if self.layers else None  # type: ignore[return-value]

    @property
    def last_kv(self) -> FastLinear | None:
        """The last layer's k / v projection apart (``keep``)."""
        return self.layers[-1].kv if self.layers else None  # type: ignore[return-value]

    def _cos_sin(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [B, q, d] of the positions: rows of the table when it covers them (the same bits as the
        rotary module's, see ``_rotary_table``), else the module's."""
        table = self.rotary_table
        if table is not None and (position_ids.numel() == 0 or int(position_ids.max()) < table[0].shape[0]):
            return table[0][position_ids], table[1][position_ids]
        return self.rotary(hidden, position_ids)

    def new_cache(self, batch: int = 0) -> FastCache:
        return FastCache(self, batch)

    @torch.inference_mode()
    def forward(
        self,
        cache: FastCache,
        input_ids: torch.Tensor,  # [B, q]
        position_ids: torch.Tensor,  # [B, q]
        slots: torch.Tensor,  # [B, q] where each token's key / value go (padding tokens: any unused slot)
        visible: torch.Tensor,  # [B, q, S] bool: the slots each token attends (S = the cache width after the call)
        keep: torch.Tensor | None = None,  # [B, r] the tokens (indices into q) whose hidden states are wanted
    ) -> torch.Tensor:  # [B, q, H] final hidden states (after the last norm); [B, r, H] with ``keep``
        """With ``keep`` (a prompt prefill: only each prompt's last token feeds a head), the last layer runs
        k / v for every token (later tokens attend to them) and q, attention, o and the MLP for the kept ones
        only; every other layer is unchanged. The kept rows' values equal the full forward's up to the
        attention call's rounding (one query row instead of q)."""
        b = input_ids.shape[0]
        cache.reserve(int(visible.shape[2]), b)
        hidden = F.embedding(input_ids, self.embed)  # [B, q, H]
        cos, sin = self._cos_sin(hidden, position_ids)  # [B, q, d]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, q, 1, d]
        if self.compiled_layers is not None:
            return self.compiled_layers(hidden, cos, sin, visible, slots, [kv.k for kv in cache.layers],
                                        [kv.v for kv in cache.layers], keep)
        return self.run_layers(hidden, cos, sin, slots, visible, [kv.keys for kv in cache.layers],
                               [kv.values for kv in cache.layers], keep)

    def forward_static(
        self,
        keys: list[torch.Tensor],  # per layer [B, h_kv, S, d] (views of static buffers, written in place)
        values: list[torch.Tensor],  # per layer [B, h_kv, S, d]
        input_ids: torch.Tensor,  # [B, q]
        position_ids: torch.Tensor,  # [B, q] (within the rotary table)
        slots: torch.Tensor,  # [B, q]
        visible: torch.Tensor,  # [B, q, S] bool
        keep: torch.Tensor | None = None,  # [B, r]
    ) -> torch.Tensor:  # [B, q, H]; [B, r, H] with ``keep``
        """``forward`` over given key / value buffers and with no host read (no cache bookkeeping, the
        rotary table indexed without a range check): fixed shapes in, fixed shapes out, so a CUDA graph can
        capture it (``recsvc.engine.kernels.buckets``, ``recsvc.engine.kernels.cuda_graphs``). The same ops as
        ``forward``."""
        hidden = F.embedding(input_ids, self.embed)  # [B, q, H]
        if self.rotary_table is not None:
            cos, sin = self.rotary_table[0][position_ids], self.rotary_table[1][position_ids]
        else:
            cos, sin = self.rotary(hidden, position_ids)
        return self.run_layers(hidden, cos[:, :, None], sin[:, :, None], slots, visible, keys, values, keep)

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   visible: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                   keep: torch.Tensor | None) -> torch.Tensor:
        """The decoder layers (``slot_layer``, or its compiled runner) and the final norm: hidden [B, q, H],
        cos / sin [B, q, 1, d]; each new token's key / value is written into ``keys[i]`` / ``values[i]``
        ([B, h_kv, S, d]) at its slot, and attention runs over those S slots under ``visible``."""
        last = len(self.layers) - 1
        for i, (w, k_i, v_i) in enumerate(zip(self.layers, keys, values, strict=True)):
            kept = keep if i == last else None
            if self.compiled_layer is not None and kept is None:
                out = self.compiled_layer(w, hidden, cos, sin, slots, visible, k_i, v_i)
                if out is not None:  # else compilation failed: the eager layer below
                    hidden = out
                    continue
            hidden = slot_layer(self.shape, w, hidden, cos, sin, slots, visible, k_i, v_i, kept)
        return F.rms_norm(hidden, self.hidden_shape, self.norm, self.norm_eps)


def _rotary_table(rotary: torch.nn.Module, cfg, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos / sin [P, d] of positions 0..P-1 (P = max_position_embeddings) from the model's own rotary module,
    for the "default" rope only (a position's values do not depend on the other positions of the call: the
    module's matmul has an inner size of 1, one rounding per entry; ``FastLlama`` indexes the table instead of
    running the module per forward); None for other rope types (scaled / dynamic: the module per forward)."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    n = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if rope.get("rope_type", rope.get("type", "default")) != "default" or n <= 0:
        return None
    with torch.inference_mode():
        cos, sin = rotary(like[:1], torch.arange(n, device=like.device)[None])  # [1, P, d]
    return cos[0], sin[0]
