"""An item prior fused into beam search (recsvc.engine.scoring.prior): the trie factorisation is exact, plain beam
search returns fused scores (and the prior's order when the prior dominates), no prior / weight 0 changes nothing, and
relaxed sampling renormalises the fused distributions. Strict speculative decoding with the prior equals plain beam
search with the prior: tests/test_engine_speculative.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import (
    SCORE_TOL,
    TEXT_VOCAB,
    batch,
    peaked_probs,
    random_catalog,
    random_prompts,
    tiny_llama,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.prior import prior_log_mass, step_bias
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.search.sampling import make_generators, sampling_beam_search, tempered_logp
from recsvc.engine.speculation.relaxed.relaxed import relaxed_speculative_search
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

L = 4


def item_step_sums(trie: CatalogTrie, prior: torch.Tensor) -> torch.Tensor:
    """[B, n] sum over each item's L steps of the bias the engine adds (prior[child] - prior[parent])."""
    path = trie.item_path  # [n, L+1]
    total = torch.zeros(prior.shape[0], path.shape[0])
    for d in range(1, path.shape[1]):
        total += prior[:, path[:, d]] - prior[:, path[:, d - 1]]
    return total


# ---- the factorisation ---------------------------------------------------------------------------------------
def test_worked_example_from_the_docstring() -> None:
    ids = SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0)}, codebook_size=4)
    trie = CatalogTrie(ids)
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    prior = prior_log_mass(trie, probs, 1.0)
    torch.testing.assert_close(prior[0].exp(), torch.tensor([1.0, 0.8, 0.2, 0.5, 0.3, 0.2]))
    assert prior[0, 0].item() == 0.0  # the root
    # the steps of each item add up to w * log P(item)
    for w in (0.5, 2.0):
        prior = prior_log_mass(trie, probs, w)
        torch.testing.assert_close(item_step_sums(trie, prior), w * probs.log())
    # the engine's per-candidate bias: from the root, codes 1 and 2 lead to masses 0.8 and 0.2
    bias = step_bias(prior_log_mass(trie, probs, 1.0), torch.tensor([[0]]), trie.children[0].view(1, 1, -1))
    torch.testing.assert_close(bias[0, 0, 1:3], torch.tensor([0.8, 0.2]).log())


def test_collided_leaf_holds_the_mass_of_all_its_items() -> None:
    ids = SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 10: (1, 2)}, codebook_size=4)  # 7 and 10 collide
    trie = CatalogTrie(ids)
    probs = torch.tensor([[0.5, 0.3, 0.2]])  # rows: items 7, 8, 10
    m = prior_log_mass(trie, probs, 1.0)[0].exp()
    leaf_7 = int(trie.item_path[0, -1])
    assert leaf_7 == int(trie.item_path[2, -1])
    torch.testing.assert_close(m[leaf_7], torch.tensor(0.7))
    torch.testing.assert_close(m[int(trie.item_path[1, -1])], torch.tensor(0.3))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 60), weight=st.floats(0.05, 5.0), scale=st.floats(0.1, 10.0))
def test_node_mass_is_the_sum_of_its_items_and_steps_telescope(seed, n, weight, scale) -> None:
    ids = random_catalog(n, 3, 4, seed)
    trie = CatalogTrie(ids)
    probs = peaked_probs(n, 2, seed) * scale  # unnormalised input: normalised by the root's mass
    prior = prior_log_mass(trie, probs, weight)
    p = probs / probs.sum(1, keepdim=True)
    for node in range(trie.num_nodes):  # brute force: the items whose path passes through the node
        under = (trie.item_path == node).any(1)
        expect = weight * p[:, under].sum(1).log()
        torch.testing.assert_close(prior[:, node], expect.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(item_step_sums(trie, prior), weight * p.log(), atol=1e-4, rtol=1e-4)


def test_weight_zero_gives_zeros_and_zero_mass_gives_minus_inf() -> None:
    ids = SemanticIds.from_mapping({7: (1, 2), 8: (1, 3), 9: (2, 0)}, codebook_size=4)
    trie = CatalogTrie(ids)
    assert torch.equal(prior_log_mass(trie, torch.tensor([[0.0, 1.0, 0.0]]), 0.0), torch.zeros(1, trie.num_nodes))
    prior = prior_log_mass(trie, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), 1.0)
    assert torch.isinf(prior[0, [2, 3, 5]]).all() and prior[0, [0, 1, 4]].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(prior[1], torch.zeros(trie.num_nodes))  # no information: no bias
    with pytest.raises(ValueError):
        prior_log_mass(trie, torch.tensor([[0.5, 0.5]]), 1.0)  # not one column per item
    with pytest.raises(ValueError):
        prior_log_mass(trie, torch.tensor([[0.5, -0.5, 1.0]]), 1.0)


# ---- plain beam search -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup():
    ids = random_catalog(400, L, 16, seed=0)
    trie = CatalogTrie(ids)
    model = EngineModel.build(tiny_llama(L, 16, seed=0))
    return ids, trie, model


def forced_logp(model, prompt: list[int], codes: list[int], codebook: int) -> float:
    """The model's own sum of code log-probs of an item (full-vocabulary log_softmax, one causal forward)."""
    toks = prompt + [TEXT_VOCAB + lv * codebook + c for lv, c in enumerate(codes)]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([toks])).logits[0].float(), -1)
    t = len(prompt)
    return float(sum(logp[t - 1 + lv, toks[t + lv]] for lv in range(len(codes))))


def test_none_and_weight_zero_give_todays_outputs_exactly(setup) -> None:
    _, trie, model = setup
    prompts = random_prompts(4, seed=11)
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    ref = engine.search(batch(prompts), 10)
    none = engine.search(batch(prompts), 10, prior=None)
    zero = engine.search(batch(prompts), 10, prior=prior_log_mass(trie, peaked_probs(len(trie.ids), 4, 1), 0.0))
    for out in (none, zero):
        assert torch.equal(out.leaves, ref.leaves) and torch.equal(out.scores, ref.scores)
        assert all(torch.equal(a, b) for a, b in zip(out.beams, ref.beams, strict=True))


def test_scores_are_model_log_probs_plus_weighted_log_prior(setup) -> None:
    ids, trie, model = setup
    prompts = random_prompts(3, seed=12)
    probs = peaked_probs(len(ids), 3, 2)
    w = 0.7
    out = BeamSearch(model, trie, TEXT_VOCAB).search(batch(prompts), 8, prior=prior_log_mass(trie, probs, w))
    codes = trie.codes_of_nodes(out.leaves)  # [B, K, L]
    for r, prompt in enumerate(prompts):
        for j in range(8):
            row = ids.index_of(trie.leaf_items(out.leaves[r, j : j + 1])[0])
            expect = forced_logp(model.model, prompt, codes[r, j].tolist(), 16) + w * float(probs[r, row].log())
            assert abs(out.scores[r, j].item() - expect) < SCORE_TOL
    assert (out.scores[:, :-1] >= out.scores[:, 1:]).all()


def dominant_prior(ids, rows: int, k: int, seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """[rows, n] item probabilities where k random items of row r (seeded ``seed + r``) hold 1/2, 1/4, ... and
    every other item 1e-9; and those items per row, in that order."""
    n = len(ids)
    probs = torch.full((rows, n), 1e-9)
    tops = []
    for r in range(rows):
        top = torch.randperm(n, generator=torch.Generator().manual_seed(seed + r))[:k]
        probs[r, top] = 0.5 ** torch.arange(1, k + 1, dtype=torch.float32)
        tops.append([int(ids.item_ids[i]) for i in top])
    return probs, tops


def test_a_dominant_prior_gives_the_priors_top_items_in_its_order(setup) -> None:
    """Top-K items of P far above the rest (each above the whole tail): every prefix holding one outranks every
    other prefix, so beam search keeps them and ranks them by P; the model's scores become negligible."""
    ids, trie, model = setup
    k = 6
    prompts = random_prompts(3, seed=13)
    probs, tops = dominant_prior(ids, rows=3, k=k, seed=0)
    out = BeamSearch(model, trie, TEXT_VOCAB).search(batch(prompts), k, prior=prior_log_mass(trie, probs, 200.0))
    for r in range(3):
        assert trie.leaf_items(out.leaves[r]) == tops[r]
    # without the prior the model ranks other items
    plain = BeamSearch(model, trie, TEXT_VOCAB).search(batch(prompts), k)
    assert any(trie.leaf_items(plain.leaves[r]) != tops[r] for r in range(3))


def test_exclusions_with_a_prior(setup) -> None:
    ids, trie, model = setup
    prompts = random_prompts(2, seed=14)
    prior = prior_log_mass(trie, peaked_probs(len(ids), 2, 3), 1.0)
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    first = engine.search(batch(prompts), 5, prior=prior)
    excluded = [trie.leaf_items(first.leaves[r, :2]) for r in range(2)]
    out = engine.search(batch(prompts), 5, dead=trie.dead_nodes(excluded), prior=prior)
    for r in range(2):
        got = trie.leaf_items(out.leaves[r])
        assert not set(got) & set(excluded[r])
        before = dict(zip(trie.leaf_items(first.leaves[r]), first.scores[r].tolist(), strict=True))
        for item, score in zip(got, out.scores[r].tolist(), strict=True):  # an item's fused score is its own
            if item in before:
                assert abs(score - before[item]) < SCORE_TOL


# ---- relaxed (sampling) mode: the fused, renormalised distributions ---------------------------------------------
def test_fused_sampling_distributions_are_normalised(setup) -> None:
    ids, trie, model = setup
    prompts = random_prompts(2, seed=16)
    prior = prior_log_mass(trie, peaked_probs(len(ids), 2, 5), 1.5)
    cache = TreeCache(model, trie, TEXT_VOCAB, batch(prompts))
    root = torch.zeros(2, 1, dtype=torch.long)
    cache.feed(root)
    logp, child = tempered_logp(model, cache, root, torch.ones(2), None, prior)
    torch.testing.assert_close(torch.logsumexp(logp, -1), torch.zeros(2, 1), atol=1e-5, rtol=0)
    plain, _ = tempered_logp(model, cache, root, torch.ones(2), None)
    # fused = model * (m(child) / m(root))^w, renormalised: the log-ratio to the model is the bias up to a constant
    ok = torch.isfinite(plain)
    diff = (logp - plain)[ok].view(2, -1)
    bias = prior.gather(1, child.view(2, -1).clamp(min=0))[ok.view(2, -1)].view(2, -1)
    torch.testing.assert_close(diff - diff[:, :1], bias - bias[:, :1], atol=1e-4, rtol=0)


def test_sampling_with_a_dominant_prior_returns_the_priors_items(setup) -> None:
    ids, trie, model = setup
    k = 4
    prompts = random_prompts(2, seed=17)
    probs, tops = dominant_prior(ids, rows=2, k=k, seed=10)
    tops = [set(t) for t in tops]
    prior = prior_log_mass(trie, probs, 200.0)
    temp = torch.ones(2)
    smp = sampling_beam_search(model, trie, TEXT_VOCAB, batch(prompts), k, temp, make_generators([1, 2]), None,
                               prior)
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, 16, 3, hidden=16, layers=1)), trie, TEXT_VOCAB)
    pb = batch(prompts)
    rel = relaxed_speculative_search(model, trie, TEXT_VOCAB, pb, k, drafter.sampling_session(pb, [], None, prior),
                                     k, 3, temp, make_generators([1, 2]), None, prior)
    for r in range(2):
        assert set(trie.leaf_items(smp.leaves[r])) == tops[r]
        assert set(trie.leaf_items(rel.leaves[r])) == tops[r]
    again = sampling_beam_search(model, trie, TEXT_VOCAB, batch(prompts), k, temp, make_generators([1, 2]), None,
                                 prior)
    assert torch.equal(again.leaves, smp.leaves)


def test_transition_prior_feeds_the_engine(setup) -> None:
    """The real prior class end to end: TransitionPrior.probs rows are the trie's item rows."""
    from recsvc.priors.transition import PriorSettings, TransitionPrior

    ids, trie, model = setup
    items = ids.item_ids.tolist()
    rng = np.random.default_rng(0)
    seqs = [rng.choice(items[:30], size=8).tolist() for _ in range(50)]
    prior = TransitionPrior.fit(seqs, items, PriorSettings(weight=1.0))
    histories = [seqs[0][:4], seqs[1][:3]]
    probs = torch.from_numpy(prior.probs(histories))
    fused = prior_log_mass(trie, probs, prior.settings.weight)
    torch.testing.assert_close(item_step_sums(trie, fused), probs.double().div(probs.double().sum(1, keepdim=True))
                               .log().float(), atol=1e-4, rtol=1e-4)
    out = BeamSearch(model, trie, TEXT_VOCAB).search(batch(random_prompts(2, seed=18)), 5, prior=fused)
    assert (out.leaves >= 0).all()
