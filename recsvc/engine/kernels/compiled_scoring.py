"""A decode step's scoring as one compiled graph: the LM head, its log-softmax over the vocabulary, the level's
code columns, every child's candidate score (the trie, the request's exclusions, the fused prior's step term) and
the best 2K + 1 candidates with the tie check that beam selection makes before it reads the best K
(``recsvc.engine.scoring.expand.select_from_best``).

Eager, this is ``EngineModel.code_logprobs`` then ``recsvc.engine.scoring.expand.candidate_scores``: the head's
matmul and ~25 small ATen ops around it, each a Python call and a pass over its tensor. ``ExportedScoring`` exports it
once with every size dynamic (requests, beams, catalog nodes) and compiles it like the layer graphs
(``recsvc.engine.kernels.compiled_stack.export_and_compile``). Measured on the Beauty `small` target (fp32, one CPU
thread, in a hot loop): 383 -> 235 us for 20 beams, 185 -> 94 us for one. The compiled forward (``--forward compiled``)
scores plain beam search's steps with it (``BeamSearch``; the first step too, unless every prompt's first log-probs come
from the user-state cache: the graph also returns the log-probs it scored, which that cache keeps).

Exactness: the graph must give the eager path's very bits, because strict speculative decoding scores with the
eager head and must equal plain beam search. ``ExportedScoring`` checks that when it compiles (probe calls of 1
to 37 beams, one and several requests, with and without a prior and exclusions, against the eager path); where a
build of the kernels does not give the same bits, it reports ``exact`` False and the callers score eagerly. On both
CPUs measured (AMD Zen 4 with AVX512-BF16, Intel Xeon with AMX) that is the case for bf16 models (their eager head
packs its weight for F.linear's bf16 bits, the graph's matmul rounds otherwise), so only fp32 models use the graph.

Shapes: B requests, n beams, H hidden, V vocabulary, C codebook size, N trie nodes, N_i internal nodes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.export import Dim

from recsvc.engine.kernels.compiled_stack import export_and_compile
from recsvc.engine.scoring.expand import candidate_scores
from recsvc.engine.scoring.topk import distinct_best
from tokenizer_rqvae.trie import CatalogTrie

MIN_BEST = 3  # the graph returns at least the best 3 candidates (the tie check compares neighbours)


class CandidateScoring(torch.nn.Module):
    """The LM head and the candidate scores of one decode step (what ``ExportedScoring`` compiles)."""

    def __init__(self, head: torch.Tensor) -> None:  # [V, H] the LM head's weight
        super().__init__()
        self.head = torch.nn.Parameter(head.detach(), requires_grad=False)
        self.eval()

    def forward(
        self,
        hidden: torch.Tensor,  # [B, n, H] the beams' final hidden states
        cols: torch.Tensor,  # [C] the vocabulary columns of the level's codes
        nodes: torch.Tensor,  # [B, n] the beams' trie nodes (-1: dead)
        scores: torch.Tensor,  # [B, n] float32 their scores
        children: torch.Tensor,  # [N_i, C] the trie's child table (-1: no child)
        prior: torch.Tensor,  # [B, N] float32 w * log prior mass (zeros: no prior)
        dead: torch.Tensor,  # [B, N] bool excluded nodes (all False: none)
        width: torch.Tensor,  # [T] (its size only): how many best candidates to return, T >= 3
    ) -> tuple[torch.Tensor, ...]:
        """(cand [B, n, C] float32 (-inf: not allowed), child [B, n, C] long, the best T candidates' scores and
        flat indices into n * C [B, T], sorted, whether they are all real (> ``INVALID``) and pairwise
        distinct (``recsvc.engine.scoring.topk.distinct_best``, a 0-d bool), and the level's log-probs [B, n, C]
        (``EngineModel.code_logprobs``'s; the first step keeps them in the user-state cache))."""
        b, n, h = hidden.shape
        logits = F.linear(hidden.reshape(b * n, h), self.head).float()  # [B n, V]
        logp = torch.log_softmax(logits, dim=-1).index_select(1, cols).view(b, n, -1)  # [B, n, C]
        internal = (nodes >= 0) & (nodes < children.shape[0])
        child = torch.where(internal[..., None], children[torch.where(internal, nodes, 0)], -1)  # [B, n, C]
        at = child.clamp(min=0).view(b, -1)  # [B, n C]
        mask = (child >= 0) & ~dead.gather(1, at).view(child.shape)
        step = scores[..., None] + logp
        step = step + (prior.gather(1, at).view(child.shape) - prior.gather(1, nodes.clamp(min=0))[..., None])
        cand = torch.where(mask, step, float("-inf"))
        top_v, top_i = torch.topk(cand.reshape(b, -1), width.shape[0], dim=1)
        return cand, child, top_v, top_i, distinct_best(top_v), logp


class ExportedScoring:
    """``CandidateScoring`` compiled on its first call (thread-safe), then called directly; checked against the
    eager path (``exact``) right after it compiles."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor) -> None:
        """``head``: the eager LM head (``[M, H] -> [M, V]``) whose bits the graph must reproduce; ``weight`` its
        [V, H] weight."""
        self.eager_head = head
        self.module = CandidateScoring(weight)
        self._graph: Callable[..., tuple[torch.Tensor, ...]] | None = None
        self._exact: bool | None = None
        self._lock = threading.Lock()
        self._cols: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}
        self._widths: dict[tuple[int, torch.device], torch.Tensor] = {}  # size carriers of ``best``
        self._zeros: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # no prior / dead

    @property
    def exact(self) -> bool | None:
        """Whether the compiled graph gives the eager path's bits (None: not compiled yet)."""
        return self._exact

    def __call__(
        self,
        hidden: torch.Tensor,  # [B, n, H]
        nodes: torch.Tensor,  # [B, n] trie nodes of depth ``level`` (-1: dead)
        scores: torch.Tensor,  # [B, n]
        trie: CatalogTrie,
        level: int,  # the code level the step chooses
        code_offset: int,
        dead: torch.Tensor | None,  # [B, N]
        prior: torch.Tensor | None,  # [B, N]
        best: int = MIN_BEST,  # T: how many best candidates to return (at least MIN_BEST, at most n C)
    ) -> tuple[torch.Tensor, ...] | None:  # CandidateScoring.forward's outputs; None: score eagerly
        if self._graph is None:
            with self._lock:
                if self._graph is None:
                    graph = self._compile(trie)
                    self._exact = self._check(graph, trie, code_offset)
                    self._graph = graph
        if not self._exact or not MIN_BEST <= best <= nodes.shape[1] * trie.codebook_size:
            return None
        if prior is None or dead is None:  # the graph reads them only: shared zeros per shape
            key = (nodes.shape[0], trie.num_nodes, nodes.device)
            zeros = self._zeros.get(key)
            if zeros is None:
                zeros = self._zeros[key] = (torch.zeros(key[:2], device=key[2]),
                                            torch.zeros(key[:2], dtype=torch.bool, device=key[2]))
            prior = zeros[0] if prior is None else prior
            dead = zeros[1] if dead is None else dead
        return self._graph(hidden.contiguous(), self._level_cols(trie, level, code_offset, nodes.device),
                           nodes.contiguous(), scores.float().contiguous(), trie.children, prior.contiguous(),
                           dead.contiguous(), self._width(best, nodes.device))

    def _width(self, best: int, device: torch.device) -> torch.Tensor:
        key = (best, device)
        width = self._widths.get(key)
        if width is None:
            width = self._widths[key] = torch.empty(best, device=device)
        return width

    def _level_cols(self, trie: CatalogTrie, level: int, code_offset: int, device: torch.device) -> torch.Tensor:
        c = trie.codebook_size
        key = (level, code_offset, c, device)
        cols = self._cols.get(key)
        if cols is None:
            cols = self._cols[key] = code_offset + level * c + torch.arange(c, device=device)
        return cols

    def _compile(self, trie: CatalogTrie) -> Callable[..., tuple[torch.Tensor, ...]]:
        """Export from example inputs of small, pairwise distinct sizes (none assumed equal to another or to 1)."""
        w = self.module.head
        dev, c = w.device, trie.codebook_size
        b, n, n_int, n_nodes = 2, 3, 5, 7
        args = (torch.zeros(b, n, w.shape[1], dtype=w.dtype, device=dev), torch.arange(c, device=dev),
                torch.zeros(b, n, dtype=torch.long, device=dev), torch.zeros(b, n, device=dev),
                torch.full((n_int, c), -1, dtype=torch.long, device=dev), torch.zeros(b, n_nodes, device=dev),
                torch.zeros(b, n_nodes, dtype=torch.bool, device=dev), torch.empty(MIN_BEST + 1, device=dev))
        B, N, NI, NN = Dim("b", min=1), Dim("n", min=1), Dim("ni", min=1), Dim("nn", min=2)
        shapes = ({0: B, 1: N}, None, {0: B, 1: N}, {0: B, 1: N}, {0: NI}, {0: B, 1: NN}, {0: B, 1: NN},
                  {0: Dim("t", min=MIN_BEST)})
        return export_and_compile(self.module, args, shapes)

    @torch.inference_mode()
    def _check(self, graph: Callable[..., tuple[torch.Tensor, ...]], trie: CatalogTrie,
               code_offset: int) -> bool:
        """The graph's outputs equal the eager path's (``candidate_scores``, then ``torch.topk``), bit for bit, on probe
        inputs over ``trie``."""
        w = self.module.head
        dev, c = w.device, trie.codebook_size
        gen = torch.Generator().manual_seed(0)
        internal = max(int(trie.children.shape[0]), 1)
        level = 1 % max(trie.levels, 1)
        cols = self._level_cols(trie, level, code_offset, dev)
        for b, n in ((1, 1), (1, 2), (1, 3), (1, 10), (1, 20), (3, 7), (2, 37)):
            hidden = torch.randn(b, n, w.shape[1], generator=gen).to(w)
            nodes = torch.randint(0, internal, (b, n), generator=gen).to(dev)
            nodes[0, -1] = -1  # a dead beam
            scores = -torch.rand(b, n, generator=gen).to(dev)
            prior = -torch.rand(b, trie.num_nodes, generator=gen).to(dev)
            dead = torch.rand(b, trie.num_nodes, generator=gen).to(dev) < 0.1
            for p, d in ((prior, dead), (None, None)):
                logp = torch.log_softmax(self.eager_head(hidden.reshape(b * n, -1)).float(), dim=-1)
                logp = logp.index_select(1, cols).view(b, n, c)
                want = candidate_scores(trie, nodes, scores, logp, d, p)
                best = min(2 * n + 1, n * c)
                if best < MIN_BEST:
                    continue
                got = graph(hidden, cols, nodes, scores, trie.children,
                            p if p is not None else torch.zeros_like(prior),
                            d if d is not None else torch.zeros_like(dead), torch.empty(best, device=dev))
                top = torch.topk(want[0].reshape(b, -1), best, dim=1)
                if not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
                        and torch.equal(top.values, got[2]) and torch.equal(top.indices, got[3])
                        and torch.equal(logp, got[5])):
                    return False
        return True
