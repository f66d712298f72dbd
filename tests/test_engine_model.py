"""EngineModel: one object per model holds its attention mode and lean forward; nothing is set on the model."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama
from transformers import DynamicCache

from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.attention import TREE_ATTENTION
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.lean import LeanCache, LeanLlama
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16


def no_engine_attributes(model) -> bool:
    return not hasattr(model, "recsvc_attention") and not hasattr(model, "_recsvc_lean")


def spy(em: EngineModel, trees: list) -> None:
    """Record the TreeGroups of every forward of ``em``."""
    forward = em.forward

    def recording(cache, ids, positions, tree):
        trees.append(tree)
        return forward(cache, ids, positions, tree)

    em.forward = recording  # type: ignore[method-assign]


@pytest.mark.parametrize("attention", ["exact", "fp32"])
def test_the_factory_switches_the_model_and_the_object_holds_the_mode(attention: str) -> None:
    trie = CatalogTrie(random_catalog(100, L, C, seed=1))
    target, draft = tiny_llama(L, C, seed=1), tiny_llama(L, C, seed=2, hidden=16, layers=1)
    engine = BeamSearch(EngineModel.build(target, attention), trie, TEXT_VOCAB)
    drafter = LlamaDrafter(EngineModel.build(draft, attention), trie, TEXT_VOCAB)
    for em, model in ((engine.model, target), (drafter.model, draft)):
        assert em.model is model and em.attention == attention and em.fp32 == (attention == "fp32")
        assert model.config._attn_implementation == TREE_ATTENTION
        assert em.hidden_size == model.config.hidden_size and em.dtype == model.dtype
        assert em.vocab_size == TEXT_VOCAB + L * C
    pb = batch(random_prompts(2, seed=1))
    plain = engine.search(pb, 5)
    spec = speculative_search(engine.model, trie, TEXT_VOCAB, pb, 5, drafter.session(pb, [], None), 5, 3, None,
                              engine.select)
    assert torch.equal(spec.leaves, plain.leaves)
    assert engine.model.lean() is not None and drafter.model.lean() is not None  # both run the lean forward
    assert no_engine_attributes(target) and no_engine_attributes(draft)  # ... held by the EngineModels


def test_the_mode_reaches_the_key_sets() -> None:
    """"fp32" splits the generated tokens' attention (TreeGroups.split); "exact" gathers each token's keys."""
    trie = CatalogTrie(random_catalog(100, L, C, seed=3))
    model = tiny_llama(L, C, seed=3)
    seen: dict[str, list] = {}
    for attention in ("exact", "fp32"):
        # two objects over one model: each keeps its own mode (the lean forward: the fast one takes masks)
        em = EngineModel.build(model, attention, forward="lean")
        spy(em, seen.setdefault(attention, []))
        BeamSearch(em, trie, TEXT_VOCAB).search(batch(random_prompts(2, seed=3)), 3)
        cache = TreeCache(em, trie, TEXT_VOCAB, batch(random_prompts(2, seed=4)))
        cache.feed(torch.nonzero(trie.depth == 1).reshape(-1)[:2].view(2, 1))
        cache.feed(torch.nonzero(trie.depth == 2).reshape(-1)[:2].view(2, 1))
    assert len(seen["exact"]) == len(seen["fp32"]) == L + 2
    assert all(t.split is None for t in seen["exact"]) and all(t.split is not None for t in seen["fp32"])
    assert no_engine_attributes(model)


def test_unknown_mode_is_refused_and_unsupported_models_keep_transformers_forward(monkeypatch) -> None:
    model = tiny_llama(L, C, seed=5)
    with pytest.raises(ValueError, match="attention mode"):
        EngineModel.build(model, "fast")
    assert isinstance(EngineModel.build(model).new_cache(), LeanCache)
    monkeypatch.setattr(LeanLlama, "supported", staticmethod(lambda m: False))
    em = EngineModel.build(model)
    assert em.lean() is None and isinstance(em.new_cache(), DynamicCache)
    assert no_engine_attributes(model)


def test_each_engine_model_has_its_own_lean_forward_rebuilt_after_training() -> None:
    model = tiny_llama(L, C, seed=6)
    a, b = EngineModel.build(model), EngineModel.build(model)
    lean_a = a.lean()
    assert lean_a is not None and lean_a is a.lean() and lean_a is not b.lean()  # one prefix cache each
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)  # an optimizer step
    assert a.lean() is not lean_a  # rebuilt from the new weights
