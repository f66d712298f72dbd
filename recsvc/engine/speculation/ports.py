"""The engine's ports: what a drafter implements and what the speculative loops hand it.

A drafter is created once (``Drafter``); each batch of requests opens a session that may keep state (a KV
cache, the retrieval candidates). Strict verification (``speculative.py``) drives a ``DraftSession``: it
proposes the top-N draft beams per depth. Relaxed verification (``relaxed.py``) drives a ``SamplingSession``:
it samples N sequences per depth and reports its distribution (``DraftStep``). Drafts are trie nodes: a node
is a code prefix, so a drafted beam and its prefix tree are the same thing.

``TargetState`` gives a strict session read access to the target of the same rows (its final hidden states
and next-code log-probs at trie nodes): what a drafter conditioned on the target (a ReDrafter-style head)
reads. Drafters that do not need it ignore it.

What the layers above need of a drafter besides its sessions is a capability of the port, never a test of its
class: ``samples`` (relaxed verification), ``model`` (its own transformer, run with the target's forward),
``draft_head`` (a recurrent head on the target's hidden states, which rule decoding's look-ahead runs) and
``over`` (the same drafter over a live catalog's trie).

Shapes: R unfinished requests of the round (the rows of ``roots``), Kc current beams, m queried nodes, N draft
width, n drafter beams, C codebook size, H the target's hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.plan import ForwardPlan
from recsvc.engine.search.beam_search import node_logprobs
from recsvc.engine.search.noise import NoiseStream
from recsvc.errors import UserError
from tokenizer_rqvae.trie import CatalogTrie


class TargetState:
    """The target's state for the round's rows (row r = row r of ``roots``), read through its ``TreeCache``.

    Nodes not cached yet are fed first, in ONE target forward for all of them (with their uncached ancestors):
    the root before the first target forward (that forward is the prompt prefill), or a beam the target chose
    at a rejected depth (cached only once the next verification feeds it). Such a forward is a target call like
    any other: it is counted in the request's ``target_calls`` (``SpecOutput``), and the verification does not
    feed those nodes again. ``cached`` tells which nodes are free to read."""

    def __init__(self, model: EngineModel, cache: TreeCache) -> None:
        self.model = model  # the target (its embeddings / LM head: ``model.model``)
        self._cache = cache

    @property
    def plan(self) -> ForwardPlan:
        """The target's forward plan: with ``sync_free`` its forwards read nothing from the device, and a drafter
        then avoids host reads too, computing both sides of a choice rather than asking which one applies;
        with ``capture`` a drafter's fixed-shape work may be captured as CUDA graphs."""
        return self.model.plan

    @property
    def prefilled(self) -> bool:
        """The prompt prefill has run (known on the host: no device read)."""
        return self._cache.prefilled

    def cached(self, nodes: torch.Tensor) -> torch.Tensor:
        """[R, m] nodes (-1 none) -> [R, m] bool: True where reading them costs no target forward."""
        c = self._cache
        slot = c.slot_of_node.gather(1, nodes.clamp(min=0))
        return (nodes < 0) | ((nodes == 0) & c.prefilled) | ((nodes >= 1) & (slot >= 0))

    def hidden_at(self, nodes: torch.Tensor, cached: bool = False) -> torch.Tensor:
        """[R, m] trie nodes (0 = the root = the prompt's last token; -1 none: zeros) -> [R, m, H] the target's
        final hidden state there (after the last norm). ``cached``: the caller knows every node is cached (the
        root aside, which the prompt prefill caches): a sync-free target then neither looks them up nor runs a
        forward (the promise is checked on a CPU, ``TreeCache.hidden_at``)."""
        self._cache.feed(nodes, bound=0 if cached else None)  # no-op when all are cached
        return self._cache.hidden_at(nodes)

    def logprobs_at(self, nodes: torch.Tensor, cached: bool = False) -> torch.Tensor:
        """[R, m] trie nodes -> [R, m, C] the target's next-code log-probs there (``node_logprobs``: full-vocabulary
        log_softmax, the level's codes; neither trie-masked nor prior-fused). ``cached``: as ``hidden_at``."""
        self._cache.feed(nodes, bound=0 if cached else None)
        return node_logprobs(self.model, self._cache, nodes)


@dataclass(frozen=True)
class DraftStep:
    """What a sampling session sampled at one depth, and what the verifier needs of its distribution there."""

    nodes: torch.Tensor  # [R, N] sampled nodes (-1 none)
    logq: torch.Tensor  # [R, N] log q_s(node) (normalised over the step's candidates)
    parents: torch.Tensor  # [R, n] the drafter's beams the step extended (-1 none)
    parent_logq: torch.Tensor  # [R, n, C] log q_s(child) of each parent's children (normalised, -inf = none)


class Session(Protocol):
    """What both loops call on a session between rounds."""

    calls: int  # drafter forward calls so far (0 for training-free drafters)

    def observe(self, beams: torch.Tensor) -> None:  # [R, K] the target's beams after the round
        ...

    def select_rows(self, rows: torch.Tensor) -> None:  # [R'] keep only these requests (others finished)
        ...


class DraftSession(Session, Protocol):
    """Strict verification's port."""

    # every drafted node's parent is a root or a node this session drafted one depth above: the verification
    # then feeds the tree at its bound without reading its size (sync-free targets; checked once per search)
    closed_tree: bool

    def propose(
        self,
        roots: torch.Tensor,  # [R, Kc] the target's current beams (trie nodes of depth j_r; -1 dead)
        root_scores: torch.Tensor,  # [R, Kc] their target scores
        steps: torch.Tensor,  # [R] how many depths to draft per row (0 = none)
        width: int,  # N: draft beams per depth
        target: TargetState,  # read access to the target at these rows (may be ignored)
        depths: int | None = None,  # max(steps) when the caller knows it on the host (no read of ``steps``)
    ) -> list[torch.Tensor]:  # max(steps) tensors [R, N]: drafted nodes at depth j_r + s (-1 = none)
        ...


class SamplingSession(Session, Protocol):
    """Relaxed verification's port."""

    def sample(
        self,
        roots: torch.Tensor,  # [R, Kc] the target's current beams (-1 dead)
        root_logp: torch.Tensor,  # [R, Kc] their sequence log-probs under the target
        steps: torch.Tensor,  # [R] depths to sample per row
        width: int,  # N >= K sequences per depth
        temperature: torch.Tensor,  # [R]
        gens: Sequence[torch.Generator] | NoiseStream,  # one per row (sync-free: the rows' NoiseStream)
        target: TargetState,  # read access to the target at these rows (may be ignored)
        depths: int | None = None,  # sync-free: max(steps) may be < depths; the draws of depth s count only if
        #                             max(steps) >= s (``noise.gated``), so the rows draw what the eager loop draws
    ) -> list[DraftStep]:  # max(steps) steps (``depths`` when given)
        ...


class Drafter(Protocol):
    name: str
    samples: bool  # True: ``sampling_session`` works (relaxed verification); False: it raises UserError
    model: EngineModel | None  # its own transformer (the LLaMA drafter's), None when it runs none
    draft_head: torch.nn.Module | None  # a recurrent draft head on the target's hidden states (the head
    #                                     drafter's ``DraftHead``), None without one; rules' cdsl look-ahead runs it

    def session(
        self,
        prompts: PromptBatch,  # the target's prompts (drafters share the target's tokenizer)
        histories: Sequence[Sequence[int]],  # item ids per request (retrieval drafters use them)
        dead: torch.Tensor | None,  # [B, num_nodes] excluded prefixes per request
        prior: torch.Tensor | None = None,  # [B, num_nodes] the target's fused item prior (recsvc.engine.scoring.prior)
    ) -> DraftSession: ...

    def sampling_session(
        self,
        prompts: PromptBatch,
        histories: Sequence[Sequence[int]],
        dead: torch.Tensor | None,
        prior: torch.Tensor | None = None,
    ) -> SamplingSession: ...

    def over(self, trie: CatalogTrie) -> Drafter:
        """This drafter, sharing its network, over another catalog's trie (a live catalog: the bundle's items and
        the added ones); a prior it holds is extended to ``trie.ids``."""
        ...


class StrictOnly:
    """Mixin for drafters that only propose (strict verification): ``samples`` is False and
    ``sampling_session`` refuses (callers check ``samples`` first: relaxed mode then runs the target's own
    sampling beam search)."""

    name: str
    samples = False

    def sampling_session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]], dead: torch.Tensor | None,
                         prior: torch.Tensor | None = None) -> SamplingSession:
        raise UserError(f"the {self.name} drafter does not sample: relaxed verification needs a sampling drafter "
                        "(llama)")
