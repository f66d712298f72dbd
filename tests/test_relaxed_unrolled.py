"""Relaxed speculation over the bucketed forward, unrolled like strict (recsvc.engine.speculation.relaxed.unrolled):
the eager loop's lists for the same seeds (the NoiseStream hands each request the numbers the loop draws), and a request
in a handful of replayable units with one host read (the LLaMA pairing's shape)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, counted_request, random_catalog, random_prompts, tiny_llama

from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.search.noise import NoiseStream
from recsvc.engine.search.sampling import make_generators
from recsvc.engine.speculation.relaxed.keep import KEEPS
from recsvc.engine.speculation.relaxed.relaxed import relaxed_speculative_search
from recsvc.engine.speculation.relaxed.unrolled import noise_budget
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(400, L, C, 21))
    target = EngineModel.build(tiny_llama(L, C, 21, hidden=64, layers=2), "fp32", forward="bucketed")
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, C, 24, hidden=32, layers=1), "fp32", forward="bucketed"),
                           trie, TEXT_VOCAB)
    return trie, target, drafter


def _relaxed(setup, prompts, k, n, gamma, seeds, unrolled, dead=None, prior=None, keep="draw-order"):
    trie, target, drafter = setup
    temps = torch.full((len(seeds),), 0.8)
    return relaxed_speculative_search(target, trie, TEXT_VOCAB, prompts, k,
                                      drafter.sampling_session(prompts, [], dead, prior), n, gamma, temps,
                                      make_generators(seeds), dead, prior, unrolled=unrolled, keep=keep)


@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize(("k", "n", "gamma", "n_prompts"), [(10, 10, 3, 1), (6, 12, 3, 3), (4, 8, 2, 4),
                                                           (5, 5, 1, 2)])
def test_unrolled_relaxed_gives_the_eager_loops_lists(setup, k: int, n: int, gamma: int, n_prompts: int,
                                                      keep: str) -> None:
    """Both keep rules: uniform draws its pick's numbers where the verification draws, draw-order draws none."""
    prompts = batch(random_prompts(n_prompts, 60 + k, min_len=3, max_len=30))
    for first in (0, 100, 200):
        seeds = list(range(first, first + n_prompts))
        eager = _relaxed(setup, prompts, k, n, gamma, seeds, unrolled=False, keep=keep)
        out = _relaxed(setup, prompts, k, n, gamma, seeds, unrolled=True, keep=keep)
        assert out.host_counts is not None and eager.host_counts is None
        assert torch.equal(out.leaves, eager.leaves), (seeds, out.leaves, eager.leaves)
        torch.testing.assert_close(out.logp, eager.logp, atol=1e-4, rtol=0)
        assert torch.equal(out.target_calls, eager.target_calls) and torch.equal(out.accepted, eager.accepted)
        assert out.host_counts == (eager.target_calls.tolist(), eager.accepted.tolist())


@pytest.mark.parametrize("keep", KEEPS)
def test_unrolled_relaxed_with_exclusions_and_a_fused_prior(setup, keep: str) -> None:
    trie = setup[0]
    prompts = batch(random_prompts(3, 77, min_len=3, max_len=30))
    dead = trie.dead_nodes([[int(i) for i in trie.ids.item_ids[:40]]] * 3)
    probs = torch.rand(3, trie.item_path.shape[0], generator=torch.Generator().manual_seed(5))
    prior = prior_log_mass(trie, probs, 0.7)
    for first in (0, 50):
        seeds = [first, first + 1, first + 2]
        eager = _relaxed(setup, prompts, 6, 8, 3, seeds, False, dead, prior, keep)
        out = _relaxed(setup, prompts, 6, 8, 3, seeds, True, dead, prior, keep)
        assert torch.equal(out.leaves, eager.leaves) and torch.equal(out.accepted, eager.accepted)
        excluded = set(trie.leaf_items(out.leaves[out.leaves >= 0]))
        assert not excluded & {int(i) for i in trie.ids.item_ids[:40]}


def test_the_noise_budget_bounds_every_draw_and_an_overdraft_is_reported() -> None:
    gens = make_generators([1, 2])
    stream = NoiseStream(gens, 4, "cpu")
    stream.take((3,))
    assert not bool(stream.overdrawn())
    stream.take((3,), when=torch.tensor([True, False]))
    assert stream.cursor.tolist() == [6, 3] and bool(stream.overdrawn())
    # the budget covers the largest request: every round's drafting and both replay alternatives at every depth
    assert noise_budget(4, 3, 10, 10, 256, "uniform") >= 4 * (3 * 10 * 256 + 4 * (2 * 10 + 2 * 10 * 256)) // 2
    # draw-order's pick draws nothing: N fewer per verified depth (3 + 3 + 2 + 1 of them over the 4 rounds)
    assert noise_budget(4, 3, 10, 10, 256, "uniform") - noise_budget(4, 3, 10, 10, 256, "draw-order") == 9 * 10


@pytest.mark.parametrize("n_prompts", [1, 3])
def test_a_relaxed_request_is_a_handful_of_replays_and_one_read(setup, n_prompts: int) -> None:
    """The bench pairing's shape: a relaxed request launches at most twice plain's eager ops from Python, replays
    at most 4 graphs more than plain's (L rounds of sampling, verification and replay against plain's L forwards
    and L steps) and reads the device once (its counters; the lists are the caller's read)."""
    trie, target, drafter = setup
    engine = BeamSearch(target, trie, TEXT_VOCAB)
    prompts = batch(random_prompts(n_prompts, 80 + n_prompts, min_len=3, max_len=30))
    _, plain_ops, plain_replays, plain_reads = counted_request(engine, None, prompts, "plain", seeded=True)
    relaxed, ops, replays, reads = counted_request(engine, drafter, prompts, "relaxed", seeded=True)
    assert relaxed.decoding.mode == "relaxed"
    assert ops <= 2 * plain_ops and replays <= plain_replays + 4 and reads <= 2, (ops, plain_ops, replays, reads)
    assert replays == 3 * L and reads == 1 and plain_reads == 0
