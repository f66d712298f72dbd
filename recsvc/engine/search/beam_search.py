"""Plain trie-constrained beam search: the reference the speculative engine must reproduce exactly.

Exactly L steps. Step 1 scores the first code from the prompt's last position; each later step feeds the K
beams' last tokens (tree attention over one cache row per request, no KV copies: ``BeamCache``) and extends
them.
Scores follow transformers' ``generate(num_beams=K, prefix_allowed_tokens_fn=trie)``: full-vocabulary
log_softmax in float32, disallowed codes at -inf, a beam's score is the sum of its steps' log-probs. Ties:
see ``recsvc.engine.scoring.topk``. An optional item prior is fused step by step (``recsvc.engine.scoring.prior``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from recsvc.engine.caches.beam_cache import BeamCache
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.compiled_scoring import MIN_BEST
from recsvc.engine.kernels.cuda_graphs import FunctionGraphs
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger
from recsvc.engine.scoring.expand import candidate_scores, select_candidates, select_from_best
from recsvc.engine.scoring.topk import GenerateSelector, IndexSelector, Selector
from recsvc.engine.search.last_step import Score, bounded_last_step
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class BeamOutput:
    leaves: torch.Tensor  # [B, K] trie leaf nodes, best first (-1: fewer than K valid items)
    scores: torch.Tensor  # [B, K] float32 sums of log-probs (-inf where leaves == -1)
    target_calls: int  # forward calls of the model for the whole batch
    beams: list[torch.Tensor]  # L tensors [B, K]: the beams (nodes) after each step (the oracle drafts these)
    prompt_hidden: torch.Tensor | None = None  # [B, H] final hidden state at each prompt's last token (the prefill's)


def node_logprobs(model: EngineModel, cache: TreeCache, nodes: torch.Tensor) -> torch.Tensor:
    """[B, m] cached nodes -> [B, m, C] log-probs of the codes that may follow each (level = node depth)."""
    return hidden_logprobs(model, cache.trie, cache.code_offset, cache.hidden_at(nodes), nodes)


def hidden_logprobs(model: EngineModel, trie: CatalogTrie, code_offset: int, hidden: torch.Tensor,
                    nodes: torch.Tensor) -> torch.Tensor:
    """The nodes' hidden states [B, m, H] -> [B, m, C] log-probs of the codes that may follow each node [B, m]."""
    levels = trie.depth[nodes.clamp(min=0)].clamp(max=trie.levels - 1)  # [B, m]
    flat = model.code_logprobs(hidden.reshape(-1, hidden.shape[-1]), levels.reshape(-1), code_offset,
                               trie.codebook_size)
    return flat.view(*nodes.shape, -1)


def to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` on ``device`` (no copy when it is there already; None stays None): per-request inputs (exclusions,
    priors) are moved to the model's device once per search, never per step."""
    return t if t is None or t.device == device else t.to(device)


def make_selector(model: EngineModel, trie: CatalogTrie, code_offset: int, tie_break: str) -> Selector:
    """"generate": transformers' exact selection (ties included); "index": lower beam, then lower code."""
    if tie_break == "index":
        return IndexSelector()
    if tie_break != "generate":
        raise ValueError(f"tie_break must be 'generate' or 'index', got {tie_break!r}")
    return GenerateSelector(model.vocab_size, code_offset, trie.codebook_size, trie.levels)


class BeamSearch:
    def __init__(self, model: EngineModel, trie: CatalogTrie, code_offset: int, tie_break: str = "generate") -> None:
        """``model``: ``EngineModel.build(transformers_model, attention)`` (it holds the attention mode)."""
        self.model, self.trie, self.code_offset = model, trie.to(model.device), code_offset
        self.select = make_selector(model, trie, code_offset, tie_break)
        self._steps: FunctionGraphs | None = None  # the sync-free forwards' head + selection per step

    def step_graphs(self) -> FunctionGraphs | None:
        """With a sync-free forward, a step's LM head, trie expansion and selection run as one function of its
        tensors (``_head_select``): captured as a CUDA graph per (rows, beams, step, width) under ``graphs`` on a
        GPU, eager elsewhere. Per search object, since the graphs read this trie's tables. None otherwise."""
        if not self.model.plan.step_graphs:
            return None
        capture = self.model.plan.capture
        if self._steps is None or self._steps.capture != capture:
            self._steps = FunctionGraphs(capture=capture)
        return self._steps

    @torch.inference_mode()
    def search(self, prompts: PromptBatch, width: int, dead: torch.Tensor | None = None,
               prior: torch.Tensor | None = None, ledger: Ledger = NO_LEDGER,
               states: UserStateCache | None = None, count: bool = True, top: int | None = None) -> BeamOutput:
        """dead: [B, num_nodes] excluded prefixes; prior: [B, num_nodes] ``prior_log_mass`` to fuse (scores are
        then fused scores), None = the model alone (bit-identical to transformers' generate). ``states``: the
        user-state cache (fast forward only): cached prompts are not run again, computed ones are stored.
        ``count``: whether its lookups count as hits / misses (False: work ahead of a request). ``top``: the
        caller reads only the best ``top`` beams (< width): the last step then feeds only the beams that can reach
        them (``recsvc.engine.search.last_step``; the fast forward, which runs on a CPU; steps not kept in ``states``)
        and ``leaves`` / ``scores`` are [B, top], the first ``top`` of the full search's."""
        dev = self.model.device  # every tensor of the search lives there (inputs moved once, here)
        prompts = prompts.to(dev)
        dead, prior = to_device(dead, dev), to_device(prior, dev)
        cache = BeamCache(self.model, self.trie, self.code_offset, prompts, states, count)
        pre = cache.fast_prefill
        b = len(prompts.lengths)
        nodes = torch.zeros(b, 1, dtype=torch.long, device=dev)  # the root
        scores = torch.zeros(b, 1, device=dev)
        parents = torch.zeros(b, 1, dtype=torch.long, device=dev)
        beams = []
        levels = self.trie.levels
        graphs = self.step_graphs()
        prompt_hidden: torch.Tensor | None = None
        plan = self.model.plan  # its stopping test reads the device: sync-free runs the full step
        bounded = (top is not None and 0 < top < width and levels > 1 and plan.fast and not cache.keeps_steps
                   and not plan.sync_free)
        for step in range(levels):
            if bounded and step == levels - 1:
                with ledger.phase("last"):
                    nodes, scores, parents, _ = bounded_last_step(
                        self.trie, nodes, scores, self._last_score(cache, nodes, scores, parents, step, dead, prior),
                        int(top), self.select)
                beams.append(nodes)
                break
            # the prompt prefill first, then the beams' last tokens: [B * K, H] -> [B, K, C] next-code log-probs
            with ledger.phase("forward"):
                hidden = cache.prefill()[:, None] if step == 0 else cache.feed(nodes, parents)
            if step == 0:  # a copy: a captured forward's output buffer is overwritten by the next replay
                prompt_hidden = hidden[:, 0].clone()
            remember = step == 0 and pre is not None and pre.states is not None  # the user-state cache keeps logp
            if graphs is not None and not (remember and pre.cached_first() is not None):
                with ledger.phase("head"):  # head + selection: one function, one graph replay on a GPU
                    nodes, scores, parents, logp = graphs.run(
                        ("plain step", step, width, remember),
                        partial(self._head_select, step=step, width=width, keep_logp=remember),
                        (hidden, nodes, scores, dead, prior))
                if remember:
                    pre.remember(hidden[:, 0], logp[:, 0])
                beams.append(nodes)
                continue
            with ledger.phase("head"):  # the LM head and the candidates' scores (one compiled graph where it can)
                if step == 0 and pre is not None and (logp := pre.cached_first()) is not None:
                    cand, child = candidate_scores(self.trie, nodes, scores, logp[:, None], dead, prior)
                    best = None  # every first code's log-probs from the user-state cache
                else:
                    cand, child, best, logp = self._candidates(hidden, nodes, scores, step, dead, prior, 2 * width + 1)
                    if step == 0 and pre is not None:  # kept in the user-state cache for its full hits
                        pre.remember(hidden[:, 0], logp[:, 0])
            with ledger.phase("select"):
                picked = select_from_best(best, child, width) if best is not None else None
                nodes, scores, parents = picked or select_candidates(self.trie, nodes, cand, child, width, self.select)
            beams.append(nodes)
        if top is not None and top < nodes.shape[1]:  # the bounded last step returns top already
            nodes, scores, beams[-1] = nodes[:, :top], scores[:, :top], nodes[:, :top]
        return BeamOutput(nodes, scores, cache.calls, beams, prompt_hidden)

    def _head_select(self, hidden: torch.Tensor, nodes: torch.Tensor, scores: torch.Tensor,
                     dead: torch.Tensor | None, prior: torch.Tensor | None, step: int, width: int,
                     keep_logp: bool = False) -> tuple[torch.Tensor, ...]:
        """One step after its forward: hidden [B, n, H] of the beams ``nodes`` / ``scores`` [B, n] -> the next
        (nodes, scores, parents) [B, width], as the eager "head" and "select" phases compute them, and the step's
        log-probs [B, n, C] when ``keep_logp`` (else an empty tensor)."""
        logp = self._step_logprobs(hidden, step)
        cand, child = candidate_scores(self.trie, nodes, scores, logp, dead, prior)
        picked = select_candidates(self.trie, nodes, cand, child, width, self.select)
        return (*picked, logp if keep_logp else logp[:0])

    def _last_score(self, cache: BeamCache, nodes: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
                    step: int, dead: torch.Tensor | None, prior: torch.Tensor | None) -> Score:
        """The bounded last step's ``score(first, stop)``: beams first..stop-1 forward, then their candidates."""

        def score(first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = cache.feed_part(nodes, parents, first, stop)
            cand, child, _, _ = self._candidates(hidden, nodes[:, first:stop], scores[:, first:stop], step, dead,
                                                 prior)
            return cand, child

        return score

    def _candidates(self, hidden: torch.Tensor, nodes: torch.Tensor, scores: torch.Tensor, step: int,
                    dead: torch.Tensor | None, prior: torch.Tensor | None, best: int = MIN_BEST
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                               torch.Tensor]:
        """[B, n, H] hidden states of the beams ``nodes`` [B, n] (depth ``step``) -> (cand, child) [B, n, C], the
        ``best`` best candidates with their tie flag (``select_from_best``) from the compiled scoring graph where
        the model has one (the same bits), else None (the eager head and ``candidate_scores``), and the step's
        log-probs [B, n, C]."""
        scoring = self.model.scoring()
        if scoring is not None:
            out = scoring(hidden, nodes, scores, self.trie, step, self.code_offset, dead, prior,
                          min(best, nodes.shape[1] * self.trie.codebook_size))
            if out is not None:
                cand, child, values, flat, distinct, logp = out
                return cand, child, (values, flat, distinct), logp
        logp = self._step_logprobs(hidden, step)
        cand, child = candidate_scores(self.trie, nodes, scores, logp, dead, prior)
        return cand, child, None, logp

    def _step_logprobs(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """[B, n, H] hidden states of beams at depth ``step`` -> [B, n, C] log-probs of the next code."""
        b, n, h = hidden.shape
        level = torch.full((b * n,), step, dtype=torch.long, device=hidden.device)
        logp = self.model.code_logprobs(hidden.reshape(-1, h), level, self.code_offset, self.trie.codebook_size)
        return logp.view(b, n, -1)
