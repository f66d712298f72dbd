"""Sampling beam search (the relaxed mode's target baseline) and its building blocks.

Distributions here are trie-masked and renormalised: p(code | prefix) = softmax(logits / T) over the codes the
trie allows after the prefix (minus exclusions). A beam's weight is its sequence log-probability P(y) (sum of
those). One step samples K distinct children of the current beams without replacement, with probability
proportional to exp(P(child)) (Gumbel-top-K). Every request has its own ``torch.Generator``, so a seeded
request gives the same items whatever batch it shares.
With a fused item prior (``recsvc.engine.scoring.prior``) every step's distribution is the renormalised product
p_T(code | prefix) * (m(child) / m(prefix))^w: a locally normalised fusion (the sampled items follow the product
of the per-step fused distributions, not a global softmax of the fused item scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.prior import step_bias
from recsvc.engine.search.beam_search import node_logprobs, to_device
from recsvc.engine.search.noise import NoiseStream
from tokenizer_rqvae.trie import CatalogTrie


def make_generators(seeds: Sequence[int | None]) -> list[torch.Generator]:
    """One CPU generator per request (deliberately on the host on every device: a seeded request draws the same
    numbers on a CPU and a GPU; ``gumbel`` moves the noise to the model's device in one copy)."""
    gens = []
    for s in seeds:
        g = torch.Generator()
        g.manual_seed(int(s) if s is not None else int(torch.randint(0, 2**62, (1,)).item()))
        gens.append(g)
    return gens


def uniform(shape: tuple[int, ...], gens: Sequence[torch.Generator], rows: Sequence[int] | None = None,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, *shape] U(0, 1) noise, row b drawn from the CPU generator gens[rows[b]], then moved to ``device`` in one
    copy (the draws, hence seeded results, do not depend on the device). ``gens`` may be a ``NoiseStream``: the same
    numbers, drawn ahead and read on the device (``recsvc.engine.search.noise``)."""
    if isinstance(gens, NoiseStream):
        return gens.take(shape, rows)
    rows = list(range(len(gens))) if rows is None else list(rows)
    u = torch.stack([torch.rand(shape, generator=gens[r]) for r in rows])
    return u if u.device == torch.device(device) else u.to(device)


def gumbel(shape: tuple[int, ...], gens: Sequence[torch.Generator], rows: Sequence[int] | None = None,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, *shape] standard Gumbel noise on ``device``, row b drawn from gens[rows[b]] (``uniform``)."""
    u = uniform(shape, gens, rows, device)
    return -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))


def tempered_logp(model: EngineModel, cache: TreeCache, nodes: torch.Tensor, temperature: torch.Tensor,
                  dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, m] cached nodes -> (log p(code | node) [B, m, C] renormalised over allowed codes (-inf elsewhere),
    child node ids [B, m, C]). temperature: [B].

    ``prior`` ([B, num_nodes], ``recsvc.engine.scoring.prior``): the tempered log-probs gain the prior's step term
    w * (log m(child) - log m(node)) before renormalising, i.e. p(c | n) ∝ p_T(c | n) * m(c)^w (fused)."""
    return temper(cache.trie, node_logprobs(model, cache, nodes), nodes, temperature, dead, prior)


def temper(trie: CatalogTrie, logp: torch.Tensor, nodes: torch.Tensor, temperature: torch.Tensor,
           dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``tempered_logp`` from given next-code log-probs ``logp`` [B, m, C] at ``nodes`` [B, m] (a model's or a
    draft head's): divide by the temperature [B], add the prior's step term, mask, renormalise over the
    allowed codes -> (log p [B, m, C], child nodes [B, m, C])."""
    b, m = nodes.shape
    logp = logp / temperature[:, None, None]
    rows = torch.arange(b, device=nodes.device)[:, None].expand(b, m).reshape(-1)
    mask, child = trie.allowed(nodes.reshape(-1), dead, rows if dead is not None else None)
    if prior is not None:
        logp = logp + step_bias(prior, nodes, child.view(b, m, -1))
    logp = torch.where(mask.view(b, m, -1), logp, float("-inf"))
    norm = torch.logsumexp(logp, -1, keepdim=True)
    logp = torch.where(torch.isfinite(norm), logp - norm, float("-inf"))
    return logp, child.view(b, m, -1)


def sample_children(weights: torch.Tensor, child: torch.Tensor, width: int, gens: Sequence[torch.Generator],
                    rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``width`` distinct children (the beams) without replacement, P(child) ∝ exp(weight).

    weights / child: [B, n] (-inf = impossible). Returns (nodes [B, width] (-1 if fewer), weights [B, width])."""
    keys = weights + gumbel((weights.shape[1],), gens, rows, weights.device)
    keys = torch.where(torch.isfinite(weights), keys, float("-inf"))
    kk = min(width, weights.shape[1])
    top = torch.topk(keys, kk, dim=1)
    nodes = child.gather(1, top.indices)
    w = weights.gather(1, top.indices)
    ok = torch.isfinite(top.values)
    nodes, w = torch.where(ok, nodes, -1), torch.where(ok, w, float("-inf"))
    if kk < width:
        nodes = torch.cat([nodes, torch.full((len(nodes), width - kk), -1, dtype=nodes.dtype, device=nodes.device)], 1)
        w = torch.cat([w, torch.full((len(w), width - kk), float("-inf"), device=w.device)], 1)
    return nodes, w


@dataclass(frozen=True)
class SampleOutput:
    leaves: torch.Tensor  # [B, K] sampled items' leaves, ranked by sequence log-prob (-1: fewer)
    logp: torch.Tensor  # [B, K] sequence log-probs under the tempered, renormalised target
    target_calls: int


def rank_final(nodes: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.sort(weights, dim=1, descending=True, stable=True).indices
    return nodes.gather(1, order), weights.gather(1, order)


@torch.inference_mode()
def sampling_beam_search(model: EngineModel, trie: CatalogTrie, code_offset: int, prompts: PromptBatch, width: int,
                         temperature: torch.Tensor, gens: Sequence[torch.Generator],
                         dead: torch.Tensor | None = None, prior: torch.Tensor | None = None,
                         states: UserStateCache | None = None) -> SampleOutput:
    """The target's own sampling beam search: L steps of K-without-replacement sampling (from the prior-fused
    distributions when ``prior`` [B, num_nodes] is given)."""
    dev = model.device  # inputs moved once; every tensor of the search lives there
    trie, prompts, temperature = trie.to(dev), prompts.to(dev), temperature.to(dev)
    dead, prior = to_device(dead, dev), to_device(prior, dev)
    cache = TreeCache(model, trie, code_offset, prompts, states)
    b = len(prompts.lengths)
    nodes = torch.zeros(b, 1, dtype=torch.long, device=dev)
    weights = torch.zeros(b, 1, device=dev)
    for _ in range(trie.levels):
        cache.feed(nodes)
        logp, child = tempered_logp(model, cache, nodes, temperature, dead, prior)
        cand = (weights[..., None] + logp).reshape(b, -1)
        nodes, weights = sample_children(cand, child.reshape(b, -1), width, gens, range(b))
    leaves, logp_seq = rank_final(nodes, weights)
    return SampleOutput(leaves, logp_seq, cache.calls)
