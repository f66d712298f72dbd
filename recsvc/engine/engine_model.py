"""One engine-side object per model the engine runs (the target, a LLaMA drafter): ``EngineModel``.

It holds the transformers model, its attention mode ("exact" | "fp32", see ``recsvc.engine.attention``) and
its lean forward (``recsvc.engine.lean.LeanLlama``: fused / pre-packed weights and the prompt-header prefix
cache, rebuilt when the parameters' version counters change), and it is the one primitive every
target / drafter call goes through: ``forward(cache, ids, positions, tree)`` over new tokens with an explicit
per-token key set. Plain beam search, the drafters and the speculative verifier all feed tokens that attend to
an arbitrary set of cached slots (the prompt, their ancestors in a beam / draft tree) and themselves; one
call keeps their numerics consistent, and the KV cache never has to be copied per beam.

Nothing is stored on the transformers model except its switch to tree attention (``config``: SDPA whenever
no tree is given, so training and ``generate`` are unchanged). Build it once per model and pass it to the
caches and searches:

    target = EngineModel.build(model, attention="fp32")
    BeamSearch(target, trie, code_offset).search(prompts, width)

Shapes: B requests, q new tokens per request, H hidden size, M scored rows, C codebook size, V vocabulary.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from recsvc.engine.attention import ATTENTION_MODES, TreeGroups, use_tree_attention
from recsvc.engine.buckets import BucketedForward, StaticCache
from recsvc.engine.compiled import compiled_layers, require_compiler
from recsvc.engine.compiled_scoring import ExportedScoring
from recsvc.engine.cuda_graphs import GraphRunner, cuda_graphs_available
from recsvc.engine.fast import FastCache, FastLlama
from recsvc.engine.lean import LeanCache, LeanLlama
from recsvc.engine.ledger import ForwardLedger

FORWARDS = ("auto", "fast", "compiled", "lean", "bucketed", "graphs", "compiled-graphs")
# the fast forward at bucketed shapes over a static KV cache (recsvc.engine.buckets)
STATIC = ("bucketed", "graphs", "compiled-graphs")


class EngineModel:
    def __init__(self, model: PreTrainedModel, attention: str, forward: str = "auto") -> None:
        """Use ``EngineModel.build`` (it switches the model to tree attention first)."""
        self.model = model
        self.attention = attention
        self._lean_supported = LeanLlama.supported(model)
        self._lean: LeanLlama | None = None
        # "fast" (recsvc.engine.fast: few ops per layer, float-rounding tolerance) serves fp32 / bf16 CPU models
        # in the "fp32" attention mode; "exact" keeps the bit-identical lean forward; "lean" forces today's path
        # the fast forward, uncompiled (False) and compiled (True), each with the parameters' version it was built at
        self._fasts: dict[tuple[bool, bool], tuple[FastLlama, tuple[int, ...]]] = {}
        self.forward_ledger: ForwardLedger | None = None  # benches: every forward's tokens and time
        self._compiled = False  # the fast forward's layers compiled (forward "compiled")
        self._layer_compiled = False  # each decoder layer a torch.compile graph (forward "compiled-graphs")
        self._scoring: tuple[FastLlama, ExportedScoring] | None = None  # the compiled forward's step scoring
        self._static = ""  # "bucketed" | "graphs" | "" (recsvc.engine.buckets / cuda_graphs)
        self._bucketed: BucketedForward | None = None
        self.graph_runner: GraphRunner | None = None
        self.set_forward(forward)

    def set_forward(self, forward: str) -> None:
        """"fast", "compiled" (the fast forward with its layers compiled by inductor: ``recsvc.engine.compiled``),
        "lean" (today's bit-identical path), "auto" (fast for fp32 / bf16 models on a CPU in "fp32" attention;
        "graphs" on a CUDA GPU, where the launches set a request's time: docs/GPU.md),
        "bucketed" (the fast forward at bucketed, padded shapes over a static KV cache: ``recsvc.engine.buckets``;
        any device) or "graphs" (the same, each bucket a CUDA graph: ``recsvc.engine.cuda_graphs``; on a CUDA
        device, elsewhere "bucketed") or "compiled-graphs" (the same with each decoder layer compiled by
        ``torch.compile``: ``recsvc.engine.compiled_layer``). "fast" is accepted on a GPU too (eager)."""
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
        if forward == "auto" and self.attention == "fp32" and cuda_graphs_available(self.model.device):
            forward = "graphs"
        static = forward in STATIC and self._lean_supported and self.model.dtype in (torch.float32, torch.bfloat16)
        fast = static or (self._lean_supported and self.model.dtype in (torch.float32, torch.bfloat16)
                          and (self.model.device.type == "cpu" or forward == "fast")
                          and (forward in ("fast", "compiled") or forward == "auto" and self.attention == "fp32"))
        if fast and forward == "compiled":
            require_compiler()  # before anything changes
        self._fast_wanted, self._compiled = fast, fast and forward == "compiled"
        # "graphs" captures on CUDA only; elsewhere it is the bucketed path, uncaptured
        captured = forward in ("graphs", "compiled-graphs") and cuda_graphs_available(self.model.device)
        self._static = ("graphs" if captured else "bucketed") if static else ""
        self._layer_compiled = static and forward == "compiled-graphs"
        self._bucketed = None

    @classmethod
    def build(cls, model: PreTrainedModel, attention: str = "exact", forward: str = "auto") -> EngineModel:
        """The factory: switch ``model`` to tree attention and wrap it. ``attention``: "exact" (the engine
        reproduces ``generate`` bit for bit) or "fp32" (split fp32 attention of the generated tokens, faster on
        CPUs); see ``recsvc.engine.attention``."""
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {attention!r}")
        use_tree_attention(model)
        return cls(model, attention, forward)

    # ---- what the caches and searches read -------------------------------------------------------------------
    @property
    def fp32(self) -> bool:
        """The generated tokens' attention runs split, in fp32 (``TreeGroups.split``)."""
        return self.attention == "fp32"

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (the full vocabulary the code log-probs are normalised over)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def lean(self) -> LeanLlama | None:
        """The lean forward, up to date with the parameters (rebuilt after they change in place: training
        between validations), or None for models it does not support (transformers' forward then)."""
        if not self._lean_supported:
            return None
        if self._lean is None or self._lean.stale:
            self._lean = LeanLlama(self.model)
        return self._lean

    @property
    def is_fast(self) -> bool:
        """The fast forward serves this model (callers then build ``visible`` masks: ``forward_masked``)."""
        return self._fast_wanted

    def fast(self) -> FastLlama:
        """The fast forward, rebuilt when the parameters changed in place (training between validations)."""
        lean = self.lean()  # rebuilt when stale: its recorded version is the parameters' current one
        assert lean is not None and self._fast_wanted
        version = lean.built_version
        key = (self._compiled, self._layer_compiled)
        built = self._fasts.get(key)
        if built is None or built[1] != version:
            built = self._fasts[key] = (
                FastLlama(self.model, compiled_layers if self._compiled else None, self._layer_compiled), version)
        return built[0]

    def scoring(self) -> ExportedScoring | None:
        """The compiled forward's decode-step scoring graph (``recsvc.engine.compiled_scoring``: LM head +
        candidate scores, the eager path's bits), built beside its fast forward; None for the other forwards."""
        if not self._compiled:
            return None
        fast = self.fast()
        if self._scoring is None or self._scoring[0] is not fast:
            head = fast.lm_head
            assert head.weight is not None
            self._scoring = (fast, ExportedScoring(head, head.weight))
        return self._scoring[1]

    @property
    def sync_free(self) -> bool:
        """Searches avoid host reads where a static bound does instead (the bucketed / graph forwards: a
        verification fed at its bound, no cache compaction, the replay's fixed depth count)."""
        return bool(self._static)

    def bucketed(self) -> BucketedForward | None:
        """The bucketed forward over the current fast forward (with CUDA graphs for "graphs"), or None."""
        if not self._static:
            return None
        fast = self.fast()
        if self._bucketed is None or self._bucketed.fast is not fast:
            if self._static == "graphs" and self.graph_runner is None:
                self.graph_runner = GraphRunner()
            self._bucketed = BucketedForward(fast, runner=self.graph_runner if self._static == "graphs" else None)
        return self._bucketed

    @property
    def captures(self) -> bool:
        """Forwards and plain steps are replayed from CUDA graphs ("graphs" / "compiled-graphs" on CUDA)."""
        return self._static == "graphs"

    @property
    def forward_name(self) -> str:
        if self._static:
            return f"compiled-{self._static}" if self._layer_compiled else self._static
        if self._fast_wanted:
            return "compiled" if self._compiled else "fast"
        return "lean" if self._lean_supported else "transformers"

    # ---- the primitive ---------------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache | LeanCache | FastCache:
        """An empty KV cache for ``forward``: a FastCache (fast forward), a LeanCache when the lean forward
        applies, else transformers'."""
        if self._static:
            bucketed = self.bucketed()
            assert bucketed is not None
            return bucketed.new_cache()
        if self._fast_wanted:
            return self.fast().new_cache()
        lean = self.lean()
        return lean.new_cache() if lean is not None else DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(
        self,
        cache: DynamicCache | LeanCache,
        input_ids: torch.Tensor,  # [B, q] token ids (padding: any valid id; its queries get no keys it needs)
        position_ids: torch.Tensor,  # [B, q] rotary positions (prompt length + depth - 1 for tree tokens)
        tree: TreeGroups,  # every query's exact key set (and the first call's prompts)
    ) -> torch.Tensor:  # [B, q, H] final hidden states (after the last norm)
        if self.forward_ledger is not None:
            with self.forward_ledger.forward(input_ids.numel()):
                return self._forward(cache, input_ids, position_ids, tree)
        return self._forward(cache, input_ids, position_ids, tree)

    def _forward(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor, tree: TreeGroups) -> torch.Tensor:
        if isinstance(cache, FastCache):
            slots, visible = tree_mask(cache.width, input_ids.shape, tree, input_ids.device)
            return self._fast_forward(cache, input_ids, position_ids, slots, visible, None)
        if isinstance(cache, LeanCache):
            return cache.lean.forward(cache, input_ids, position_ids, tree)
        b = input_ids.shape[0]
        # the additive mask is unused (tree attention takes the key sets); transformers wants one
        mask = torch.zeros(b, 1, 1, 1, dtype=self.model.dtype, device=input_ids.device)
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                       past_key_values=cache, use_cache=True, tree=tree)
        return out.last_hidden_state

    def forward_masked(
        self,
        cache: FastCache,
        input_ids: torch.Tensor,  # [B, q]
        position_ids: torch.Tensor,  # [B, q]
        slots: torch.Tensor,  # [B, q] cache slots the tokens are written to
        visible: torch.Tensor,  # [B, q, S] bool: the slots each token attends (itself included)
        keep: torch.Tensor | None = None,  # [B, r] the tokens whose hidden states are wanted (None: all)
    ) -> torch.Tensor:  # [B, q, H]; [B, r, H] with ``keep``
        """The fast forward's primitive (``is_fast``): explicit slots and one visibility mask for all layers."""
        if self.forward_ledger is not None:
            with self.forward_ledger.forward(input_ids.numel()):
                return self._fast_forward(cache, input_ids, position_ids, slots, visible, keep)
        return self._fast_forward(cache, input_ids, position_ids, slots, visible, keep)

    def _fast_forward(self, cache: FastCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      slots: torch.Tensor, visible: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        if isinstance(cache, StaticCache):
            bucketed = self.bucketed()
            assert bucketed is not None
            return bucketed(cache, input_ids, position_ids, slots, visible, keep)
        return cache.fast.forward(cache, input_ids, position_ids, slots, visible, keep)

    def code_logprobs(
        self,
        hidden: torch.Tensor,  # [M, H]
        level: torch.Tensor,  # [M] code level (0..L-1) whose tokens each row scores
        code_offset: int,
        codebook_size: int,
    ) -> torch.Tensor:  # [M, C] float32 log-probabilities of the level's code tokens
        """transformers' beam-score convention: log_softmax over the FULL vocabulary in float32, then the slice of
        the level's code tokens (tokens outside the trie are masked by the caller, without renormalising).

        The LM head runs only on the rows that need a next-token distribution, never on the prompt."""
        cols = code_offset + level[:, None] * codebook_size + torch.arange(codebook_size, device=hidden.device)
        if self._fast_wanted:
            head = self.fast().lm_head
        else:
            lean = self.lean()
            head = lean.lm_head if lean is not None else self.model.get_output_embeddings()
        logits = head(hidden).float()  # [M, V]
        return torch.log_softmax(logits, dim=-1).gather(1, cols)


def tree_mask(width: int, shape: torch.Size, tree: TreeGroups,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The fast forward's (slots [B, q], visible [B, q, width + q]) for tokens appended after ``width`` cached
    slots with the key sets ``tree`` describes (first-call prompts causal over their own slots; tree tokens:
    their prompt's slots and the listed ancestor / key slots); every token sees itself."""
    b, q = shape
    own = torch.arange(q, device=device)
    slots = (width + own)[None].expand(b, q)
    vis = torch.zeros(b, q, width + q, dtype=torch.bool, device=device)
    vis[:, own, width + own] = True
    if tree.prompt_lengths:  # the first call: prompts at slots 0..T_b - 1, causal
        lengths = torch.tensor(tree.prompt_lengths, device=device)
        keys = torch.arange(width + q, device=device)
        vis |= (keys[None, None] <= own[None, :, None] + width) & (keys[None, None] < lengths[:, None, None])
    for row, qidx, anc, n_prompt in tree.split or ():
        vis[row, qidx, :n_prompt] = True
        r, c = torch.nonzero(anc >= 0, as_tuple=True)
        vis[row, qidx[r], anc[r, c]] = True
    for rows, qidx, keys in tree.groups:
        vis[rows[:, None], qidx[:, None], keys] = True
    return slots, vis
