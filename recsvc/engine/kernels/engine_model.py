"""One engine-side object per model the engine runs (the target, a LLaMA drafter): ``EngineModel``.

It holds the transformers model, its forward plan (``recsvc.engine.kernels.plan.ForwardPlan``, resolved once from the
flags: attention mode, which forward, static shapes, capture, compile; the searches read its fields), the
forwards the plan runs (the fast forward per compile strategy, the bucketed forward over it) and
its lean forward (``recsvc.engine.kernels.lean.LeanLlama``: fused / pre-packed weights and the prompt-header prefix
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

from recsvc.engine.kernels.attention import ATTENTION_MODES, TreeGroups, use_tree_attention
from recsvc.engine.kernels.buckets import BucketedForward, StaticCache
from recsvc.engine.kernels.compiled_layer import compiled_layer
from recsvc.engine.kernels.compiled_scoring import ExportedScoring
from recsvc.engine.kernels.compiled_stack import compiled_layers, require_compiler
from recsvc.engine.kernels.cuda_graphs import GraphRunner
from recsvc.engine.kernels.fast import FastCache, FastLlama
from recsvc.engine.kernels.lean import LeanCache, LeanLlama
from recsvc.engine.kernels.plan import ForwardPlan, resolve
from recsvc.engine.meters.ledger import ForwardLedger


class EngineModel:
    def __init__(self, model: PreTrainedModel, plan: ForwardPlan) -> None:
        """Use ``EngineModel.build`` (it switches the model to tree attention and resolves the plan first)."""
        self.model = model
        self._lean_supported = LeanLlama.supported(model)
        self._lean: LeanLlama | None = None
        # the fast forward per compile strategy, each with the parameters' version it was built at
        self._fasts: dict[str, tuple[FastLlama, tuple[int, ...]]] = {}
        self.forward_ledger: ForwardLedger | None = None  # benches: every forward's tokens and time
        self._scoring: tuple[FastLlama, ExportedScoring] | None = None  # the compiled forward's step scoring
        self._bucketed: BucketedForward | None = None
        self.graph_runner: GraphRunner | None = None
        self.plan = plan

    def resolve(self, forward: str, attention: str | None = None) -> ForwardPlan:
        """The plan ``forward`` (a ``--forward`` value) resolves to for this model (``recsvc.engine.kernels.plan``;
        UserError for a contradiction); ``attention``: None keeps this model's."""
        dtype_ok = self.model.dtype in (torch.float32, torch.bfloat16)
        return resolve(forward, attention or self.attention, self.model.device.type, self._lean_supported,
                       self._lean_supported and dtype_ok)

    def set_forward(self, forward: str) -> None:
        """Run ``forward`` (a ``--forward`` value, resolved for this model and its attention) from now on; builds
        are kept per strategy, so switching back costs nothing (benches compare forwards in one process)."""
        plan = self.resolve(forward)
        if plan.compile == "stack":
            require_compiler()  # before anything changes
        self.plan = plan
        self._bucketed = None

    @classmethod
    def build(cls, model: PreTrainedModel, attention: str = "exact", forward: str = "auto") -> EngineModel:
        """The factory: switch ``model`` to tree attention and wrap it, its forward plan resolved from
        ``attention`` ("exact": the engine reproduces ``generate`` bit for bit; "fp32": split fp32 attention of
        the generated tokens, faster on CPUs; see ``recsvc.engine.kernels.attention``) and ``forward`` (a ``--forward``
        value: ``recsvc.engine.kernels.plan.FORWARDS``)."""
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {attention!r}")
        use_tree_attention(model)
        engine = cls(model, resolve("auto", attention, model.device.type, False, False))
        engine.set_forward(forward)
        return engine

    # ---- what the caches and searches read -------------------------------------------------------------------
    @property
    def fp32(self) -> bool:
        """The generated tokens' attention runs split, in fp32 (``TreeGroups.split``)."""
        return self.plan.attention == "fp32"

    @property
    def attention(self) -> str:
        """"exact" | "fp32" (``recsvc.engine.kernels.attention``), as the plan says; ``forward_name``: what the plan is
        called (reports and bench JSON; nothing branches on it)."""
        return self.plan.attention

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

    @property
    def forward_name(self) -> str:
        return self.plan.name

    def lean(self) -> LeanLlama | None:
        """The lean forward, up to date with the parameters (rebuilt after they change in place: training
        between validations), or None for models it does not support (transformers' forward then)."""
        if not self._lean_supported:
            return None
        if self._lean is None or self._lean.stale:
            self._lean = LeanLlama(self.model)
        return self._lean

    def fast(self) -> FastLlama:
        """The fast forward with the plan's compile strategy, rebuilt when the parameters changed in place
        (training between validations)."""
        lean = self.lean()  # rebuilt when stale: its recorded version is the parameters' current one
        assert lean is not None and self.plan.fast
        version = lean.built_version
        strategy = self.plan.compile
        built = self._fasts.get(strategy)
        if built is None or built[1] != version:
            built = self._fasts[strategy] = (
                FastLlama(self.model, compiled_layers if strategy == "stack" else None,
                          compiled_layer if strategy == "layer" else None), version)
        return built[0]

    def scoring(self) -> ExportedScoring | None:
        """The compiled forward's decode-step scoring graph (``recsvc.engine.kernels.compiled_scoring``: LM head +
        candidate scores, the eager path's bits), built beside its fast forward; None unless the plan's
        ``compiled_scoring``."""
        if not self.plan.compiled_scoring:
            return None
        fast = self.fast()
        if self._scoring is None or self._scoring[0] is not fast:
            head = fast.lm_head
            assert head.weight is not None
            self._scoring = (fast, ExportedScoring(head, head.weight))
        return self._scoring[1]

    def bucketed(self) -> BucketedForward | None:
        """The bucketed forward over the current fast forward (its buckets CUDA graphs when the plan
        captures), or None for a plan without static shapes."""
        if not self.plan.static:
            return None
        fast = self.fast()
        capture = self.plan.capture
        if self._bucketed is None or self._bucketed.fast is not fast:
            if capture and self.graph_runner is None:
                self.graph_runner = GraphRunner()
            self._bucketed = BucketedForward(fast, runner=self.graph_runner if capture else None)
        return self._bucketed

    # ---- the primitive ---------------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache | LeanCache | FastCache:
        """An empty KV cache for ``forward``: a StaticCache (static shapes), a FastCache (fast forward), a
        LeanCache (lean forward), else transformers'."""
        if self.plan.static:
            bucketed = self.bucketed()
            assert bucketed is not None
            return bucketed.new_cache()
        if self.plan.fast:
            return self.fast().new_cache()
        lean = self.lean() if self.plan.kernel == "lean" else None
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
        """The fast forward's primitive (``plan.fast``): explicit slots and one visibility mask for all layers."""
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
        if self.plan.fast:
            head = self.fast().lm_head
        else:
            lean = self.lean() if self.plan.kernel == "lean" else None
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
