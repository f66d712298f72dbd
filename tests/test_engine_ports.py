"""The strict port's TargetState: the target's hidden states / log-probs at trie nodes, every forward counted."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama

from recsvc.drafters.llama import LlamaDrafter
from recsvc.drafters.retrieval import RetrievalDatastore, RetrievalDrafter
from recsvc.engine.caches.beam_cache import BeamCache
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.ports import DraftSession, TargetState
from recsvc.engine.speculation.strict.speculative import speculative_search
from recsvc.errors import UserError
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 32


class Probe:
    """A session that reads the target's state at its roots (first round only, or every round), then lets
    ``inner`` draft: what a drafter conditioned on the target does."""

    closed_tree = False  # a wrapper promises nothing of its inner session's trees

    def __init__(self, inner: DraftSession, every_round: bool = False) -> None:
        self.inner, self.every_round = inner, every_round
        self.roots: list[torch.Tensor] = []
        self.cached: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.logp: list[torch.Tensor] = []

    @property
    def calls(self) -> int:
        return self.inner.calls

    def propose(self, roots, root_scores, steps, width, target: TargetState):
        if self.every_round or not self.roots:
            self.roots.append(roots)
            self.cached.append(target.cached(roots))
            self.hidden.append(target.hidden_at(roots))
            self.cached.append(target.cached(roots))  # now they are
            self.logp.append(target.logprobs_at(roots))
        return self.inner.propose(roots, root_scores, steps, width, target)

    def observe(self, beams):
        self.inner.observe(beams)

    def select_rows(self, rows):
        self.inner.select_rows(rows)


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(2000, L, C, 6))
    target = EngineModel.build(tiny_llama(L, C, 6, hidden=64, init=0.2, dtype=torch.bfloat16))  # exact attention
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, C, 7, hidden=32, layers=1, dtype=torch.bfloat16)), trie,
                           TEXT_VOCAB)
    return trie, target, drafter


def test_hidden_at_the_root_runs_the_prefill_and_it_is_counted(setup) -> None:
    trie, target, drafter = setup
    engine = BeamSearch(target, trie, TEXT_VOCAB)
    prompts = random_prompts(3, 6, min_len=3, max_len=40)
    pb = batch(prompts)
    base = speculative_search(target, trie, TEXT_VOCAB, pb, 10, drafter.session(pb, [], None), 10, 3, None,
                              engine.select)
    probe = Probe(drafter.session(pb, [], None))
    spec = speculative_search(target, trie, TEXT_VOCAB, pb, 10, probe, 10, 3, None, engine.select)
    assert torch.equal(spec.leaves, base.leaves) and torch.equal(spec.scores, base.scores)
    assert torch.equal(spec.leaves, engine.search(pb, 10).leaves)
    assert probe.roots[0].tolist() == [[0]] * 3  # the first round's roots: the root, before any target forward
    assert not probe.cached[0].any() and probe.cached[1].all()
    assert (spec.target_calls == base.target_calls + 1).all()  # the prefill is a target call of every row
    # the very hidden state (and first-code distribution) plain beam search's prefill gives
    plain = BeamCache(target, trie, TEXT_VOCAB, pb).prefill()  # [B, H]
    assert probe.hidden[0].shape == (3, 1, target.hidden_size) and torch.equal(probe.hidden[0][:, 0], plain)
    first = target.code_logprobs(plain, torch.zeros(3, dtype=torch.long), TEXT_VOCAB, C)
    assert torch.equal(probe.logp[0][:, 0], first)


def test_reading_uncached_beams_feeds_them_and_every_target_forward_is_counted(setup) -> None:
    trie, target, drafter = setup
    engine = BeamSearch(target, trie, TEXT_VOCAB)
    forwards: list[int] = []
    later_uncached = []  # per request: some later round read beams that were not cached
    real = target.forward
    for prompt in random_prompts(4, 9, min_len=3, max_len=30):
        pb = batch([prompt])
        probe = Probe(drafter.session(pb, [], None), every_round=True)
        target.forward = lambda *a, **kw: forwards.append(1) or real(*a, **kw)  # type: ignore[method-assign]
        try:
            forwards.clear()
            spec = speculative_search(target, trie, TEXT_VOCAB, pb, 8, probe, 4, 2, None, engine.select)
        finally:
            del target.forward
        assert int(spec.target_calls[0]) == len(forwards)  # the real count, whoever made the forward
        assert torch.equal(spec.leaves, engine.search(pb, 8).leaves)  # strict output unchanged
        for roots, hidden in zip(probe.roots, probe.hidden, strict=True):  # what a fresh target cache gives
            fresh = TreeCache(target, trie, TEXT_VOCAB, pb)
            fresh.feed(roots)
            assert torch.equal(hidden, fresh.hidden_at(roots))
        later_uncached.append(any(not c.all() for c in probe.cached[2::2]))  # [before, after] per round
    assert any(later_uncached)


def test_a_drafter_that_does_not_sample_says_so() -> None:
    trie = CatalogTrie(random_catalog(50, L, C, 1))
    drafter = RetrievalDrafter(RetrievalDatastore([[1, 2, 3]]), trie)
    assert not drafter.samples
    with pytest.raises(UserError, match="does not sample"):
        drafter.sampling_session(batch([[5, 6]]), [[1]], None)
