"""Plain trie-constrained beam search: the reference the speculative engine must reproduce exactly.

Exactly L steps. Step 1 scores the first code from the prompt's last position; each later step feeds the K
beams' last tokens (tree attention over one cache row per request, no KV copies: ``BeamCache``) and extends
them.
Scores follow transformers' ``generate(num_beams=K, prefix_allowed_tokens_fn=trie)``: full-vocabulary
log_softmax in float32, disallowed codes at -inf, a beam's score is the sum of its steps' log-probs. Ties:
see ``recsvc.engine.topk``. An optional item prior is fused step by step (``recsvc.engine.prior``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsvc.engine.beam_cache import BeamCache
from recsvc.engine.engine_model import EngineModel
from recsvc.engine.ledger import NO_LEDGER, Ledger
from recsvc.engine.prior import step_bias
from recsvc.engine.prompts import PromptBatch
from recsvc.engine.state_cache import UserStateCache
from recsvc.engine.topk import GenerateSelector, IndexSelector, Selector
from recsvc.engine.tree_cache import TreeCache
from tokenizer_rqvae.trie import CatalogTrie


@dataclass(frozen=True)
class BeamOutput:
    leaves: torch.Tensor  # [B, K] trie leaf nodes, best first (-1: fewer than K valid items)
    scores: torch.Tensor  # [B, K] float32 sums of log-probs (-inf where leaves == -1)
    target_calls: int  # forward calls of the model for the whole batch
    beams: list[torch.Tensor]  # L tensors [B, K]: the beams (nodes) after each step (the oracle drafts these)


def expand_beams(
    trie: CatalogTrie,
    nodes: torch.Tensor,  # [B, k_in] current beams (trie nodes; -1 dead)
    scores: torch.Tensor,  # [B, k_in]
    logp: torch.Tensor,  # [B, k_in, C] next-code log-probs of each beam
    k: int,
    dead: torch.Tensor | None,  # [B, num_nodes] excluded prefixes
    select: Selector | None = None,  # tie-break (default: lower index)
    prior: torch.Tensor | None = None,  # [B, num_nodes] w * log prior mass (recsvc.engine.prior) or None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One beam-search step: (nodes [B, k], scores [B, k], parent beam index [B, k]).

    With ``prior`` each candidate also gains prior[row, child] - prior[row, node], so scores are fused scores
    (sum of code log-probs + w * log m(prefix)); without it the step is exactly the unfused one."""
    b, k_in, c = logp.shape
    cand, child = candidate_scores(trie, nodes, scores, logp, dead, prior)
    level = trie.depth[nodes.max(dim=1).values.clamp(min=0)]  # [B] a row's beams share one depth
    new_scores, flat = (select or IndexSelector())(cand, k, level)
    new_nodes = child.view(b, k_in * c).gather(1, flat)
    new_nodes = torch.where(torch.isfinite(new_scores), new_nodes, torch.full_like(new_nodes, -1))
    return new_nodes, new_scores, flat // c


def candidate_scores(
    trie: CatalogTrie,
    nodes: torch.Tensor,  # [B, m] trie nodes (-1 dead)
    scores: torch.Tensor,  # [B, m]
    logp: torch.Tensor,  # [B, m, C] next-code log-probs of each node
    dead: torch.Tensor | None,  # [B, num_nodes]
    prior: torch.Tensor | None,  # [B, num_nodes] or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every child's beam score (-inf where the trie or ``dead`` forbids it; + the prior's step term) and node:
    ([B, m, C], [B, m, C] child nodes, -1 where absent). The scoring half of ``expand_beams``."""
    b, m, c = logp.shape
    rows = torch.arange(b, device=nodes.device)[:, None].expand(b, m).reshape(-1)
    mask, child = trie.allowed(nodes.reshape(-1), dead, rows if dead is not None else None)
    step = scores[..., None] + logp
    if prior is not None:
        step = step + step_bias(prior, nodes, child.view(b, m, c))
    return torch.where(mask.view(b, m, c), step, float("-inf")), child.view(b, m, c)


def node_logprobs(model: EngineModel, cache: TreeCache, nodes: torch.Tensor) -> torch.Tensor:
    """[B, m] cached nodes -> [B, m, C] log-probs of the codes that may follow each (level = node depth)."""
    trie = cache.trie
    hidden = cache.hidden_at(nodes)  # [B, m, H]
    levels = trie.depth[nodes.clamp(min=0)].clamp(max=trie.levels - 1)  # [B, m]
    flat = model.code_logprobs(hidden.reshape(-1, hidden.shape[-1]), levels.reshape(-1), cache.code_offset,
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

    @torch.inference_mode()
    def search(self, prompts: PromptBatch, k: int, dead: torch.Tensor | None = None,
               prior: torch.Tensor | None = None, ledger: Ledger = NO_LEDGER,
               states: UserStateCache | None = None, count: bool = True) -> BeamOutput:
        """dead: [B, num_nodes] excluded prefixes; prior: [B, num_nodes] ``prior_log_mass`` to fuse (scores are
        then fused scores), None = the model alone (bit-identical to transformers' generate). ``states``: the
        user-state cache (fast forward only): cached prompts are not run again, computed ones are stored.
        ``count``: whether its lookups count as hits / misses (False: work ahead of a request)."""
        dev = self.model.device  # every tensor of the search lives there (inputs moved once, here)
        prompts = prompts.to(dev)
        dead, prior = to_device(dead, dev), to_device(prior, dev)
        cache = BeamCache(self.model, self.trie, self.code_offset, prompts, states, count)
        pre = cache.fast_prefill
        b, c = len(prompts.lengths), self.trie.codebook_size
        nodes = torch.zeros(b, 1, dtype=torch.long, device=dev)  # the root
        scores = torch.zeros(b, 1, device=dev)
        parents = torch.zeros(b, 1, dtype=torch.long, device=dev)
        beams = []
        for step in range(self.trie.levels):
            # the prompt prefill first, then the beams' last tokens: [B * K, H] -> [B, K, C] next-code log-probs
            with ledger.phase("forward"):
                hidden = cache.prefill()[:, None] if step == 0 else cache.feed(nodes, parents)
            with ledger.phase("head"):
                if step == 0 and pre is not None:  # cached for full hits of the user-state cache
                    logp = pre.first_logprobs(hidden[:, 0], self.code_offset, c)
                    pre.remember(hidden[:, 0], logp)
                else:
                    level = torch.full((hidden.shape[0] * hidden.shape[1],), step, dtype=torch.long, device=dev)
                    logp = self.model.code_logprobs(hidden.reshape(-1, hidden.shape[-1]), level, self.code_offset,
                                                    c)
            with ledger.phase("select"):
                nodes, scores, parents = expand_beams(self.trie, nodes, scores, logp.view(b, -1, c), k, dead,
                                                      self.select, prior)
            beams.append(nodes)
        return BeamOutput(nodes, scores, cache.calls, beams)
