"""The GPU decode path: compiled scoring is refused off CUDA; on CUDA (when present) it returns the eager
engine's items."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama

from recsvc.engine.beam_search import BeamSearch
from recsvc.engine.engine_model import EngineModel
from recsvc.engine.gpu import compile_scoring
from recsvc.errors import UserError
from tokenizer_rqvae.trie import CatalogTrie


def test_compiled_scoring_is_refused_on_a_cpu() -> None:
    with pytest.raises(UserError, match="CUDA"):
        compile_scoring(EngineModel.build(tiny_llama(4, 8, 0)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_scoring_returns_the_eager_items_on_cuda() -> None:
    trie = CatalogTrie(random_catalog(200, 4, 16, 0)).to("cuda")
    prompts = random_prompts(3, 0)
    eager = BeamSearch(EngineModel.build(tiny_llama(4, 16, 0, device="cuda")), trie, TEXT_VOCAB)
    fast = BeamSearch(compile_scoring(EngineModel.build(tiny_llama(4, 16, 0, device="cuda"))), trie, TEXT_VOCAB)
    for k in (1, 5, 10):
        a, b = eager.search(batch(prompts), k), fast.search(batch(prompts), k)
        assert torch.equal(a.leaves, b.leaves)
        torch.testing.assert_close(a.scores, b.scores, atol=1e-4, rtol=0)
