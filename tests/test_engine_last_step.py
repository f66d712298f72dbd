"""The bounded last step (recsvc.engine.search.last_step): the first ``top`` beams of the full last step, fewer beams
fed; ties and short candidate lists fall back to the full step; plain search with ``top`` on the fast forward
returns the full search's first ``top`` beams, bit for bit."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama

from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.meters.ledger import ForwardLedger
from recsvc.engine.scoring.expand import candidate_scores, expand_beams, select_candidates, select_from_best
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.engine.scoring.topk import GenerateSelector, IndexSelector, distinct_best
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.search.last_step import FIRST_EXTRA, MIN_PART, bounded_last_step
from tokenizer_rqvae.trie import CatalogTrie

L, C, K = 4, 8, 12
TOL = 1e-4  # the fast forward's documented tolerance (recsvc/engine/kernels/fast.py)


@pytest.fixture(scope="module")
def trie() -> CatalogTrie:
    return CatalogTrie(random_catalog(900, L, C, 31))


def _beams(trie: CatalogTrie, b: int, seed: int, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K] distinct nodes of depth L - 1 with scores sorted best first (``spread``: their range)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.nonzero(trie.depth == L - 1).flatten()
    nodes = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(b)])
    scores = -(torch.rand(b, K, generator=gen) * spread).sort(dim=1).values
    return nodes, scores


def _scorer(trie: CatalogTrie, nodes: torch.Tensor, scores: torch.Tensor, logp: torch.Tensor,
            prior: torch.Tensor | None, fed: list[tuple[int, int]]):
    def score(first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        fed.append((first, stop))
        part = slice(first, stop)
        return candidate_scores(trie, nodes[:, part], scores[:, part], logp[:, part], None, prior)
    return score


@pytest.mark.parametrize("select", [IndexSelector(), GenerateSelector(TEXT_VOCAB + L * C, TEXT_VOCAB, C, L)])
@pytest.mark.parametrize("top", [1, 3, 6])
def test_bounded_step_equals_the_full_step(trie: CatalogTrie, select, top: int) -> None:
    saved = 0
    for seed in range(20):
        nodes, scores = _beams(trie, 3, seed, spread=6.0)
        gen = torch.Generator().manual_seed(100 + seed)
        logp = torch.log_softmax(3 * torch.randn(3, K, C, generator=gen), -1)
        if seed % 2:  # quantised log-probs: exact ties among the best candidates (the fallback)
            logp = (logp * 2).round() / 2
        probs = torch.rand(3, trie.item_path.shape[0], generator=gen)
        prior = prior_log_mass(trie, probs, 0.7) if seed % 3 else None
        ref_nodes, ref_scores, ref_parents = expand_beams(trie, nodes, scores, logp, K, None, select, prior)
        fed: list[tuple[int, int]] = []
        out_nodes, out_scores, parents, n_fed = bounded_last_step(
            trie, nodes, scores, _scorer(trie, nodes, scores, logp, prior, fed), top, select)
        assert torch.equal(out_nodes, ref_nodes[:, :top]) and torch.equal(parents, ref_parents[:, :top])
        assert torch.equal(out_scores, ref_scores[:, :top])
        assert fed[0] == (0, min(max(top + FIRST_EXTRA, MIN_PART), K))
        assert all(a[1] == b[0] for a, b in zip(fed, fed[1:], strict=False))  # parts follow each other
        assert n_fed == fed[-1][1]
        saved += K - n_fed
    assert saved > 0  # the bound does skip beams


def test_too_few_candidates_feed_every_beam(trie: CatalogTrie) -> None:
    nodes, scores = _beams(trie, 2, 7, spread=1.0)
    nodes[:, 2:], scores[:, 2:] = -1, float("-inf")  # two live beams, at most a few children each
    logp = torch.log_softmax(torch.randn(2, K, C, generator=torch.Generator().manual_seed(8)), -1)
    fed: list[tuple[int, int]] = []
    top = 6
    out_nodes, out_scores, _, n_fed = bounded_last_step(trie, nodes, scores,
                                                         _scorer(trie, nodes, scores, logp, None, fed), top,
                                                         IndexSelector())
    ref_nodes, ref_scores, _ = expand_beams(trie, nodes, scores, logp, K, None, IndexSelector(), None)
    assert torch.equal(out_nodes, ref_nodes[:, :top]) and torch.equal(out_scores, ref_scores[:, :top])
    if int(torch.isfinite(ref_scores[:, top - 1]).sum()) < 2:
        assert n_fed == K


def test_plain_search_with_top_on_the_fast_forward(trie: CatalogTrie) -> None:
    model = EngineModel.build(tiny_llama(L, C, 33, hidden=64, layers=2), "fp32")
    assert model.plan.fast
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    prompts = random_prompts(5, 34, min_len=3, max_len=20)
    probs = torch.rand(len(prompts), trie.item_path.shape[0], generator=torch.Generator().manual_seed(35))
    prior = prior_log_mass(trie, probs, 1.0)
    dead = trie.dead_nodes([[int(i) for i in trie.ids.item_ids[:40]]] * len(prompts))
    fed, parts = {}, 0
    for top in (None, 1, 4):
        full = engine.search(batch(prompts), K, dead, prior)
        out = engine.search(batch(prompts), K, dead, prior, top=top)  # one batch: rows fed to the batch's need
        n = top or K
        assert out.leaves.shape == (len(prompts), n) and out.beams[-1].shape == (len(prompts), n)
        assert torch.equal(out.leaves, full.leaves[:, :n]) and torch.equal(out.scores, full.scores[:, :n])
        fed[top] = 0
        for r, prompt in enumerate(prompts):  # one request at a time: the last step in parts (slots, paths)
            model.forward_ledger = ledger = ForwardLedger()
            one = engine.search(batch([prompt]), K, dead[r:r + 1], prior[r:r + 1], top=top)
            model.forward_ledger = None
            fed[top] += sum(t for t, _ in ledger.calls[L - 1:])  # tokens of the last step's forwards
            parts = max(parts, len(ledger.calls) - (L - 1))
            single = engine.search(batch([prompt]), K, dead[r:r + 1], prior[r:r + 1])
            # the parts run at the whole step's slots and key width: the very bits of the whole step
            assert torch.equal(one.leaves[0], single.leaves[0, :n]) and torch.equal(one.scores[0], single.scores[0, :n])
            assert torch.equal(one.leaves[0], full.leaves[r, :n])
            torch.testing.assert_close(one.scores[0], full.scores[r, :n], atol=TOL, rtol=0)
    assert fed[None] == len(prompts) * K and fed[1] < fed[None] and parts >= 2  # a bound that needed a 2nd part


def test_lean_forward_feeds_every_beam(trie: CatalogTrie) -> None:
    model = EngineModel.build(tiny_llama(L, C, 36), "exact")
    assert not model.plan.fast
    engine = BeamSearch(model, trie, TEXT_VOCAB)
    prompts = random_prompts(2, 37)
    full = engine.search(batch(prompts), K)
    out = engine.search(batch(prompts), K, top=3)
    assert out.target_calls == full.target_calls == L
    assert torch.equal(out.leaves, full.leaves[:, :3]) and torch.equal(out.scores, full.scores[:, :3])


@pytest.mark.parametrize("select", [IndexSelector(), GenerateSelector(TEXT_VOCAB + L * C, TEXT_VOCAB, C, L)])
def test_selecting_from_the_best_candidates_equals_selecting_from_all(trie: CatalogTrie, select) -> None:
    """``select_from_best`` (the compiled scoring graph's best 2K + 1 and tie flag) gives ``select_candidates``'
    beams when the best 2K + 1 are distinct, and declines (None) on a tie or when fewer than 2K + 1 are taken."""
    gen = torch.Generator().manual_seed(41)
    pool = torch.nonzero(trie.depth == 1).flatten()  # first-level beams: enough children for 2K + 1 candidates
    nodes = torch.stack([pool[torch.randperm(len(pool), generator=gen)] for _ in range(3)])  # [3, 8]
    scores = -(torch.rand(nodes.shape, generator=gen) * 3.0).sort(dim=1).values
    logp = torch.log_softmax(torch.randn(*nodes.shape, C, generator=gen), -1)
    cand, child = candidate_scores(trie, nodes, scores, logp, None, None)
    for k in (1, 4, K):
        top = torch.topk(cand.view(3, -1), 2 * k + 1, dim=1)
        distinct = distinct_best(top.values)
        got = select_from_best((top.values, top.indices, distinct), child, k)
        want = select_candidates(trie, nodes, cand, child, k, select)
        assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert select_from_best((top.values[:, :2 * k], top.indices[:, :2 * k], distinct), child, k) is None
        assert select_from_best((top.values, top.indices, torch.tensor(False)), child, k) is None

