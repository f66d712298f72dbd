"""The head drafter: beam search inside the recurrent draft head, rooted at the target's own beams.

A round starts from the target's current beams (depth j) and reads, through ``TargetState``, the target's final
hidden state h at each of them (cached by the previous verification; the first round's root is the prompt's
last token, whose hidden state costs the prompt prefill, counted as a target call). Then:
- depth j + 1: the target's own next-code log-probs at the beams (its LM head on h: exact, no draft error);
- depth j + 2, ...: the head (``head_model.DraftHead``) steps its recurrent state over the code just drafted
  and scores the next level's codes, conditioned on the h of the draft's root beam.
Each depth keeps the top-N beams (``expand_beams``: the trie, the request's exclusions and the fused prior
applied as the target applies them), so the drafted nodes form the tree the engine verifies in one forward.
Relaxed mode (``sample``) samples N sequences per depth from the same distributions, tempered and renormalised
as the target's sampling beam search does (``sampling.temper``).
No transformer forward runs to draft: ``calls`` stays 0; ``head_steps`` counts the head's batched steps.

Shapes: R rows, Kc the target's beams, N draft width, H hidden, S head state, C codes per level.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial

import torch

from recsvc.drafters.head_model import DraftHead
from recsvc.drafters.rows import sampled_depth, take_rows
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.kernels.cuda_graphs import FunctionGraphs
from recsvc.engine.scoring.expand import expand_beams
from recsvc.engine.search.noise import NoiseStream
from recsvc.engine.search.sampling import temper
from recsvc.engine.speculation.ports import Drafter, DraftSession, DraftStep, TargetState
from tokenizer_rqvae.trie import CatalogTrie


def _gather(t: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """[R, n, D] rows of the parents [R, N] -> [R, N, D]."""
    return t.gather(1, parent.clamp(min=0)[..., None].expand(-1, -1, t.shape[2]))


class HeadDraftSession:
    calls = 0  # no drafter forward: the head's steps are a few small matmuls

    def __init__(self, head: DraftHead, trie: CatalogTrie, dead: torch.Tensor | None,
                 prior: torch.Tensor | None, opener: DraftSession | None = None,
                 graphs_for: Callable[[bool], FunctionGraphs] | None = None) -> None:
        self.head, self.trie, self.dead, self.prior = head, trie, dead, prior
        self.opener = opener  # drafts the rows whose target has run no forward yet (see HeadDrafter)
        self.head_steps = 0
        self.graphs_for = graphs_for  # capture? -> the drafter's graphs of a round's drafting (sync-free targets)
        # every drafted node's parent is a root or a node drafted one depth above (beam search over the trie);
        # the opener's first round must promise the same for the verification to feed its bound
        self.closed_tree = opener is None or opener.closed_tree

    def _roots(self, roots: torch.Tensor, target: TargetState
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """The round's start: (h [R, Kc, H] the hidden state each root's drafts are conditioned on, the head's
        state there [R, Kc, S], next-code log-probs at the roots [R, Kc, C], whether those are all the target's
        own (no root was stepped from its parent))."""
        h, logp, from_parent = self._root_inputs(roots, target)
        read = not target.plan.sync_free  # sync-free: step every root and keep the stepped ones (no host read)
        any_parent = bool(from_parent.any()) if read else True
        self.head_steps += any_parent
        state, logp = self._root_state(roots, h, logp, from_parent, any_parent, read)
        return h, state, logp, read and not any_parent

    def _root_inputs(self, roots: torch.Tensor, target: TargetState
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the target gives a round: (h [R, Kc, H], its next-code log-probs at the cached roots [R, Kc, C],
        which roots are not cached [R, Kc])."""
        # a root the target chose at a rejected depth is not cached yet (the next verification feeds it): read
        # its parent's hidden state (cached: the target scored the root from it) and step the head over the
        # root's code instead of spending a target forward on it; the root node itself (first round) costs the
        # prompt prefill, which is a target call
        from_parent = (roots >= 1) & ~target.cached(roots)  # [R, Kc]
        base = torch.where(from_parent, self.trie.parent[roots.clamp(min=0)], roots)
        # every base is cached: a root, or the parent the target scored an uncached root from
        h = target.hidden_at(base, cached=True).to(self.head.out.dtype)  # [R, Kc, H]
        logp = target.logprobs_at(torch.where(from_parent, -1, roots), cached=True)  # [R, Kc, C]: exact where cached
        return h, logp, from_parent

    def _root_state(self, roots: torch.Tensor, h: torch.Tensor, logp: torch.Tensor, from_parent: torch.Tensor,
                    any_parent: bool, read: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's state at the roots [R, Kc, S] and the next-code log-probs there [R, Kc, C]: the target's, or
        the head's stepped over an uncached root's code from its parent."""
        trie, head = self.trie, self.head
        r, kc = roots.shape
        state = head.start(h.reshape(r * kc, -1))  # [R Kc, S]
        if any_parent:
            safe = roots.clamp(min=1)
            level = (trie.depth[safe] - 1).clamp(max=trie.levels - 2)  # a finished row's leaf roots: unused
            stepped, logq = head.step(state, h.reshape(r * kc, -1), level.reshape(-1),
                                      trie.node_code[safe].reshape(-1), read=read)
            state = torch.where(from_parent.reshape(-1, 1), stepped, state)
            logp = torch.where(from_parent[..., None], logq.view(r, kc, -1), logp)
        return state.view(r, kc, -1), logp

    def _step(self, nodes: torch.Tensor, state: torch.Tensor, h: torch.Tensor, read: bool = True,
              count: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the codes of ``nodes`` [R, n] (states / conditioning [R, n, S] / [R, n, H]) ->
        (new states [R, n, S], next-code log q [R, n, C]; -inf on dead nodes)."""
        trie = self.trie
        r, n = nodes.shape
        alive = nodes >= 1
        safe = torch.where(alive, nodes, 1)
        level = (trie.depth[safe] - 1).clamp(max=trie.levels - 2)  # [R, n] the consumed code's level
        new_state, logq = self.head.step(state.reshape(r * n, -1), h.reshape(r * n, -1), level.reshape(-1),
                                         trie.node_code[safe].reshape(-1), read=read)
        self.head_steps += count  # (a captured round counts its steps outside: its Python runs once)
        return new_state.view(r, n, -1), torch.where(alive[..., None], logq.view(r, n, -1), float("-inf"))

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, root_scores: torch.Tensor, steps: torch.Tensor, width: int,
                target: TargetState, depths: int | None = None) -> list[torch.Tensor]:
        g = depths if depths is not None else (int(steps.max()) if len(steps) else 0)
        if g == 0:
            return []
        first = (not bool(target.cached(roots[:, :1]).all())) if not target.plan.sync_free else not target.prefilled
        if self.opener is not None and first:
            # the first round: the opener's drafts ride along with the prompt prefill in one forward
            return self.opener.propose(roots, root_scores, steps, width, target, depths=depths)
        if target.plan.sync_free:  # the target's part eagerly, then the whole drafting as one function (a CUDA graph)
            h, logp, from_parent = self._root_inputs(roots, target)
            self.head_steps += g  # the root step and g - 1 depth steps
            fn = partial(self._draft_round, g, width)
            inputs = (roots, root_scores, steps, h, logp, from_parent, self.dead, self.prior)
            graphs = self.graphs_for(target.plan.capture) if self.graphs_for is not None else None
            return list(graphs.run(("head draft", g, width), fn, inputs) if graphs is not None else fn(*inputs))
        h, state, logp, exact = self._roots(roots, target)
        return self._depths(g, width, exact, roots, root_scores, steps, h, state, logp, self.dead, self.prior,
                            read=True)[0]

    def _draft_round(self, g: int, width: int, roots: torch.Tensor, root_scores: torch.Tensor,
                     steps: torch.Tensor, h: torch.Tensor, logp: torch.Tensor, from_parent: torch.Tensor,
                     dead: torch.Tensor | None, prior: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """A sync-free round's drafting from the target's part (``_root_inputs``) as a pure function of tensors:
        g tensors [R, N] (every root stepped, kept where it was not cached; no host read)."""
        state, logp = self._root_state(roots, h, logp, from_parent, True, False)
        return tuple(self._depths(g, width, False, roots, root_scores, steps, h, state, logp, dead, prior,
                                  read=False)[0])

    def _depths(self, g: int, width: int, exact: bool, roots: torch.Tensor, root_scores: torch.Tensor,
                steps: torch.Tensor, h: torch.Tensor, state: torch.Tensor, logp: torch.Tensor,
                dead: torch.Tensor | None, prior: torch.Tensor | None, read: bool
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Beam search inside the head over g depths from the roots: (the drafted nodes of each depth [R, N], the
        last depth's beam scores [R, N], best first)."""
        nodes, scores = roots, root_scores
        drafts: list[torch.Tensor] = []
        for s in range(1, g + 1):
            # depth j + 1 from cached roots is the target's own step: its top K (= the roots' count after the
            # first depth of a request) are exactly the beams the target will keep, so drafting more is waste
            n = min(width, roots.shape[1]) if s == 1 and exact and roots.shape[1] > 1 else width
            nodes, scores, parent = expand_beams(self.trie, nodes, scores, logp, n, dead, prior=prior)
            drafts.append(torch.where((steps >= s)[:, None], nodes, -1))
            if s == g:
                break
            h, state = _gather(h, parent), _gather(state, parent)  # [R, N, .] follow the kept beams
            state, logp = self._step(nodes, state, h, read=read, count=read)
        return drafts, scores

    @torch.inference_mode()
    def search_alone(self, rows: int, width: int, target: TargetState) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's drafts accepted without verification (NEZHA-style) for ``rows`` prompts: from the root, the
        target's own next-code log-probs (the prompt prefill: the request's one target forward), then the head
        beam-searches the remaining L - 1 codes -> (leaves [rows, width] best first by the head's beam score, -1:
        fewer; those scores [rows, width])."""
        levels, dev = self.trie.levels, target.model.device
        roots = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        steps = torch.full((rows,), levels, dtype=torch.long, device=dev)
        read = not target.plan.sync_free
        h, logp, from_parent = self._root_inputs(roots, target)  # the roots are the prompts: none from a parent
        state, logp = self._root_state(roots, h, logp, from_parent, False, read)
        drafts, scores = self._depths(levels, width, False, roots, torch.zeros(rows, 1, device=dev), steps, h, state,
                                      logp, self.dead, self.prior, read)
        if not read:  # (``_step`` counts only the steps that read)
            self.head_steps += levels - 1
        return drafts[-1], scores

    @torch.inference_mode()
    def sample(self, roots: torch.Tensor, root_logp: torch.Tensor, steps: torch.Tensor, width: int,
               temperature: torch.Tensor, gens: Sequence[torch.Generator] | NoiseStream, target: TargetState,
               depths: int | None = None) -> list[DraftStep]:
        """Relaxed mode: ``width`` sequences per depth sampled without replacement from the tempered, trie-masked,
        prior-fused distribution (depth j + 1: the target's own; deeper: the head's) over the children of the
        previous depth's samples, starting from the target's beams weighted by their log-probs. ``depths``
        (sync-free targets): that many depths, nothing read (``SamplingSession.sample``)."""
        read = depths is None or not target.plan.sync_free
        g = (int(steps.max()) if len(steps) else 0) if depths is None else depths
        if g == 0:
            return []
        h, state, logp, _ = self._roots(roots, target)
        nodes, weights = roots, root_logp
        r = roots.shape[0]
        most = steps.max()
        out: list[DraftStep] = []
        for s in range(1, g + 1):
            active = (steps >= s)[:, None]
            nodes = torch.where(active, nodes, -1)
            logq, child = temper(self.trie, logp, nodes, temperature, self.dead, self.prior)  # [R, n, C]
            step, new_nodes, new_w = sampled_depth(nodes, weights, logq, child, active, width, gens,
                                                    (most >= s).expand(r))
            out.append(step)
            if s == g:
                break
            parent = (self.trie.parent[new_nodes.clamp(min=0)][..., None] == nodes[:, None, :]).int().argmax(-1)
            h, state = _gather(h, parent), _gather(state, parent)  # [R, N, .]
            state, logp = self._step(new_nodes, state, h, read=read)
            nodes, weights = new_nodes, new_w
        return out

    def observe(self, beams: torch.Tensor) -> None:
        if self.opener is not None:
            self.opener.observe(beams)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.opener is not None:
            self.opener.select_rows(rows)
        self.dead, self.prior = take_rows(self.dead, rows), take_rows(self.prior, rows)


class HeadDrafter:
    """``opener``: a drafter that needs no target state (the transition drafter) for the first round of strict
    decoding. Without one, the first round reads the root's hidden state, which costs the prompt prefill as a
    target forward of its own, and the draft tree is verified in a second; with one, its drafts are verified
    together with the prefill (one forward, as the oracle's) and the head drafts every later round."""

    name = "head"
    samples = True
    model = None  # no transformer of its own: the head reads the target's hidden states

    def __init__(self, head: DraftHead, trie: CatalogTrie, opener: Drafter | None = None) -> None:
        self.draft_head, self.trie, self.opener = head, trie, opener
        self._graphs: dict[bool, FunctionGraphs] = {}  # capture? -> a round's drafting per (depths, width)
        self._lock = threading.Lock()

    def graphs(self, capture: bool) -> FunctionGraphs:
        """The drafter's graphs of a sync-free round's drafting (captured on a GPU, eager elsewhere): per drafter,
        since they bake in its head's weights and trie."""
        with self._lock:
            if capture not in self._graphs:
                self._graphs[capture] = FunctionGraphs(capture=capture)
            return self._graphs[capture]

    def over(self, trie: CatalogTrie) -> HeadDrafter:
        return HeadDrafter(self.draft_head, trie, self.opener.over(trie) if self.opener is not None else None)

    def session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]],
                dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> HeadDraftSession:
        opener = self.opener.session(prompts, histories, dead, prior) if self.opener is not None else None
        return HeadDraftSession(self.draft_head, self.trie, dead, prior, opener, self.graphs)

    def sampling_session(self, prompts: PromptBatch, histories: Sequence[Sequence[int]],
                         dead: torch.Tensor | None, prior: torch.Tensor | None = None) -> HeadDraftSession:
        return HeadDraftSession(self.draft_head, self.trie, dead, prior)
