"""The fast forward (recsvc.engine.fast): transformers' generate up to float rounding, the previous (lean)
forward's results, and strict speculation == plain beam search on it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    TEXT_VOCAB,
    batch,
    engine_codes,
    generate_reference,
    random_catalog,
    random_prompts,
    tiny_llama,
)

from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.beam_search import BeamSearch
from recsvc.engine.engine_model import EngineModel
from recsvc.engine.fast import FastCache
from recsvc.engine.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16
TOL = 1e-4  # documented in recsvc/engine/fast.py: matmuls and masked attention sum in another order


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(400, L, C, 21))
    model = tiny_llama(L, C, 21, hidden=64, layers=2)
    return trie, model


@pytest.mark.parametrize("k", [1, 4, 10])
def test_fast_plain_matches_generate_within_tolerance(setup, k: int) -> None:
    trie, model = setup
    fast = EngineModel.build(model, "fp32")
    assert fast.is_fast and fast.forward_name == "fast"
    engine = BeamSearch(fast, trie, TEXT_VOCAB)
    for prompt in random_prompts(4, 22, min_len=3, max_len=30):
        out = engine.search(batch([prompt]), k)
        ref_codes, ref_scores = generate_reference(model, trie, prompt, k)
        assert engine_codes(trie, out.leaves)[0] == ref_codes
        torch.testing.assert_close(out.scores[0][: len(ref_scores)], torch.tensor(ref_scores), atol=TOL, rtol=0)


def test_fast_and_lean_agree_and_lean_stays_available(setup) -> None:
    trie, model = setup
    fast, lean = EngineModel.build(model, "fp32"), EngineModel.build(model, "fp32", forward="lean")
    assert not lean.is_fast and lean.forward_name == "lean"
    prompts = random_prompts(5, 23, min_len=3, max_len=30)
    a = BeamSearch(fast, trie, TEXT_VOCAB).search(batch(prompts), 8)
    b = BeamSearch(lean, trie, TEXT_VOCAB).search(batch(prompts), 8)
    assert torch.equal(a.leaves, b.leaves)
    torch.testing.assert_close(a.scores, b.scores, atol=TOL, rtol=0)
    lean.set_forward("fast")
    assert lean.is_fast and isinstance(lean.new_cache(), FastCache)
    exact = EngineModel.build(model, "exact")  # the bit-identical mode keeps the lean forward
    assert not exact.is_fast


def test_strict_equals_plain_on_the_fast_forward(setup) -> None:
    trie, model = setup
    target = EngineModel.build(model, "fp32")
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, C, 24, hidden=32, layers=1), "fp32"), trie, TEXT_VOCAB)
    engine = BeamSearch(target, trie, TEXT_VOCAB)
    prompts = random_prompts(4, 25, min_len=3, max_len=30)
    for k, n, gamma in ((6, 6, 3), (4, 8, 2), (10, 10, 1)):
        plain = engine.search(batch(prompts), k)
        spec = speculative_search(target, trie, TEXT_VOCAB, batch(prompts), k,
                                  drafter.session(batch(prompts), [], None), n, gamma, None, engine.select)
        assert torch.equal(spec.leaves, plain.leaves)
        torch.testing.assert_close(spec.scores, plain.scores, atol=TOL, rtol=0)
