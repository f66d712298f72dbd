"""The engine's plain beam search returns exactly what transformers' constrained generate returns."""

from __future__ import annotations

import engine_helpers as eh
import pytest
import torch

from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.topk import select_topk
from recsvc.engine.search.beam_search import BeamSearch
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16


@pytest.fixture(scope="module")
def setup(device):
    """Per device (conftest ``device``): the catalog's trie and a tiny target there."""
    ids = eh.random_catalog(400, L, C, seed=0)
    trie = CatalogTrie(ids).to(device)
    model = eh.tiny_llama(L, C, seed=0, device=device)
    return ids, trie, model


@pytest.mark.parametrize("k", [1, 2, 5, 10, 20])
def test_same_items_same_order_as_generate(setup, device, k: int) -> None:
    _, trie, model = setup
    prompts = eh.random_prompts(4, seed=k)  # different lengths: batched with padding
    out = BeamSearch(EngineModel.build(model), trie, eh.TEXT_VOCAB).search(eh.batch(prompts), k)
    got = eh.engine_codes(trie, out.leaves)
    assert out.target_calls == L  # prefill + 3 decode steps for the whole eh.batch
    assert out.leaves.device.type == out.scores.device.type == torch.device(device).type
    for row, prompt in enumerate(prompts):
        ref_codes, ref_scores = eh.generate_reference(model, trie, prompt, k)
        assert got[row] == ref_codes
        torch.testing.assert_close(out.scores[row].cpu(), torch.tensor(ref_scores), atol=1e-4, rtol=1e-5)


def test_exclusions_match_generate_on_the_pruned_trie(setup) -> None:
    ids, trie, model = setup
    prompts = eh.random_prompts(3, seed=7)
    engine = BeamSearch(EngineModel.build(model), trie, eh.TEXT_VOCAB)
    first = engine.search(eh.batch(prompts), 5)
    # exclude each request's own top-3 items (different per request)
    excluded = [trie.leaf_items(first.leaves[r, :3]) for r in range(3)]
    out = engine.search(eh.batch(prompts), 5, dead=trie.dead_nodes(excluded))
    got = eh.engine_codes(trie, out.leaves)
    for row, prompt in enumerate(prompts):
        assert not set(trie.leaf_items(out.leaves[row])) & set(excluded[row])
        ref_codes, _ = eh.generate_reference(model, trie, prompt, 5, excluded=excluded[row])
        assert got[row] == ref_codes


def test_batched_equals_one_by_one(setup) -> None:
    _, trie, model = setup
    prompts = eh.random_prompts(5, seed=3, min_len=1, max_len=30)
    engine = BeamSearch(EngineModel.build(model), trie, eh.TEXT_VOCAB)
    together = engine.search(eh.batch(prompts), 7)
    for row, prompt in enumerate(prompts):
        alone = engine.search(eh.batch([prompt]), 7)
        assert torch.equal(alone.leaves[0], together.leaves[row])
        torch.testing.assert_close(alone.scores[0], together.scores[row], atol=1e-5, rtol=1e-5)


def test_fewer_items_than_k_returns_what_exists(device) -> None:
    ids = eh.random_catalog(3, L, C, seed=1)
    trie = CatalogTrie(ids).to(device)
    model = eh.tiny_llama(L, C, seed=1, device=device)
    out = BeamSearch(EngineModel.build(model), trie, eh.TEXT_VOCAB).search(eh.batch([[5, 6, 7]]), 5)
    assert (out.leaves[0, :3] >= 0).all() and (out.leaves[0, 3:] == -1).all()
    assert torch.isinf(out.scores[0, 3:]).all()
    assert sorted(trie.leaf_items(out.leaves[0, :3])) == sorted(ids.item_ids.tolist())


@pytest.mark.parametrize(
    "cand, k, scores, index",
    [
        ([[0.0, 2.0, 2.0, float("-inf")]], 2, [[2.0, 2.0]], [[1, 2]]),  # tie: lower index first
        ([[1.0, 3.0, 2.0]], 3, [[3.0, 2.0, 1.0]], [[1, 2, 0]]),  # plain descending order
        ([[1.0]], 2, [[1.0, float("-inf")]], [[0, 0]]),  # fewer candidates than k: padded with -inf
    ],
)
def test_select_topk_table(cand, k, scores, index) -> None:
    s, i = select_topk(torch.tensor(cand), k)
    assert s.tolist() == scores and i.tolist() == index


def test_bf16_engine_is_bit_identical_to_generate() -> None:
    """Exact tree attention + generate's selection: same items, same order, same scores, in bf16."""
    ids = eh.random_catalog(3000, L, 64, seed=2)
    trie = CatalogTrie(ids)
    model = eh.tiny_llama(L, 64, seed=2, hidden=64, init=0.2, dtype=torch.bfloat16)
    prompts = eh.random_prompts(6, seed=2, min_len=5, max_len=40)
    out = BeamSearch(EngineModel.build(model), trie, eh.TEXT_VOCAB).search(eh.batch(prompts), 10)
    got = eh.engine_codes(trie, out.leaves)
    for row, prompt in enumerate(prompts):
        ref_codes, ref_scores = eh.generate_reference(model, trie, prompt, 10)
        assert got[row] == ref_codes
        assert out.scores[row].tolist() == ref_scores


@pytest.mark.parametrize("tie_break", ["index", "generate"])
def test_tie_breaks_on_exact_ties(tie_break: str) -> None:
    """A model whose code logits are all equal: every candidate ties; the documented rule decides."""
    ids = eh.random_catalog(60, L, 8, seed=4)
    trie = CatalogTrie(ids)
    model = eh.tiny_llama(L, 8, seed=4)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits 0: all allowed codes tie at every step
    engine = BeamSearch(EngineModel.build(model), trie, eh.TEXT_VOCAB, tie_break=tie_break)
    out = engine.search(eh.batch([[5, 6, 7]]), 4)
    got = eh.engine_codes(trie, out.leaves)[0]
    if tie_break == "index":  # lower beam, then lower code: the lexicographically smallest ids
        assert got == sorted(tuple(r) for r in ids.codes.tolist())[:4]
    else:
        assert got == eh.generate_reference(model, trie, [5, 6, 7], 4)[0]
