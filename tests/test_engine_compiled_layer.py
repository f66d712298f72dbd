"""The "compiled-graphs" forward (recsvc.engine.kernels.compiled_layer): the bucketed forward with each decoder
layer one torch.compile graph (inductor's C++ backend here, triton on CUDA) gives the bucketed forward's lists, plain
and strict, and compiles a few graphs, not one per bucket."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama

from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                                reason="inductor's CPU backend needs a C++ compiler")
L, C = 4, 16
TOL = 1e-4  # fp32: fused loops change only the summation order


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(300, L, C, 23))
    return trie, tiny_llama(L, C, 23, hidden=64, layers=2), tiny_llama(L, C, 25, hidden=32, layers=1)


def _same(a, b) -> None:
    assert torch.equal(a.leaves, b.leaves)
    finite = torch.isfinite(a.scores)
    assert torch.equal(finite, torch.isfinite(b.scores))
    torch.testing.assert_close(a.scores[finite], b.scores[finite], atol=TOL, rtol=0)


def test_compiled_layers_give_the_bucketed_lists_plain_and_strict(setup) -> None:
    trie, model, draft = setup
    bucketed = EngineModel.build(model, "fp32", forward="bucketed")
    compiled = EngineModel.build(model, "fp32", forward="compiled-graphs")
    assert compiled.forward_name == ("compiled-graphs" if model.device.type == "cuda" else "compiled-bucketed")
    assert compiled.plan.sync_free and compiled.plan.fast
    plain_b, plain_c = BeamSearch(bucketed, trie, TEXT_VOCAB), BeamSearch(compiled, trie, TEXT_VOCAB)
    for n_prompts, seed, k in ((1, 60, 10), (3, 61, 5), (2, 62, 20)):
        prompts = batch(random_prompts(n_prompts, seed, min_len=3, max_len=30))
        _same(plain_c.search(prompts, k), plain_b.search(prompts, k))
    layer = compiled.fast().compiled_layer
    assert layer is not None and not layer.failed and layer.calls > 0  # it ran, compiled
    drafter_b = LlamaDrafter(EngineModel.build(draft, "fp32", forward="bucketed"), trie, TEXT_VOCAB)
    prompts = batch(random_prompts(2, 70, min_len=3, max_len=30))
    ref = plain_b.search(prompts, 10)
    out = speculative_search(compiled, trie, TEXT_VOCAB, prompts, 10, drafter_b.session(prompts, [], None), 10, 3,
                             None, plain_c.select)
    _same(out, ref)  # strict over the compiled target stays lossless
