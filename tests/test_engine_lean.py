"""The lean forward (plain tensor ops, fused projections, prefix cache) changes no bit of the engine's output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import TEXT_VOCAB, batch, engine_codes, generate_reference, random_catalog, tiny_llama

from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels import lean as lean_mod
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.lean import LeanCache, LeanLlama
from recsvc.engine.kernels.pieces import LeanLinear
from recsvc.engine.search.beam_search import BeamSearch
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 32
HEADER = [1, 7, 9, 4, 12, 3, 18, 5, 6, 11, 20, 8]  # every prompt starts with it, like the real prompt header


def header_prompts(n: int, seed: int, max_items: int = 6) -> list[list[int]]:
    """HEADER + 1..max_items history items of L codes and a separator: the real prompts' shape."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        items = int(rng.integers(1, max_items + 1))
        body = []
        for _ in range(items):
            body += [TEXT_VOCAB + lv * C + int(rng.integers(C)) for lv in range(L)] + [2]
        out.append(HEADER + body)
    return out


@pytest.fixture(params=[2, 4], ids=["gqa", "mha"])
def bf16_setup(request):
    ids = random_catalog(300, L, C, seed=3)
    model = tiny_llama(L, C, seed=4, hidden=64, init=0.2, dtype=torch.bfloat16, kv_heads=request.param)
    return CatalogTrie(ids), model


def search(model, trie, prompts, k, lean: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(LeanLlama, "supported", staticmethod(lambda m: lean))  # read when the EngineModel is built
    out = BeamSearch(EngineModel.build(model), trie, TEXT_VOCAB).search(batch(prompts), k)
    return out.leaves, out.scores


def test_engine_uses_the_lean_forward_for_llama(bf16_setup) -> None:
    trie, model = bf16_setup
    cache = TreeCache(EngineModel.build(model), trie, TEXT_VOCAB, batch(header_prompts(2, 0)))
    assert isinstance(cache.cache, LeanCache)


@pytest.mark.parametrize("k", [1, 5, 10])
def test_lean_is_bit_identical_to_transformers_and_equals_generate(bf16_setup, k: int, monkeypatch) -> None:
    trie, model = bf16_setup
    prompts = header_prompts(5, seed=k)  # different lengths, batched
    slow = search(model, trie, prompts, k, lean=False, monkeypatch=monkeypatch)
    fast = search(model, trie, prompts, k, lean=True, monkeypatch=monkeypatch)
    assert torch.equal(slow[0], fast[0]) and torch.equal(slow[1], fast[1])
    got = engine_codes(trie, fast[0])
    for row, prompt in enumerate(prompts):
        assert got[row] == generate_reference(model, trie, prompt, k)[0]


def test_prefix_cache_is_used_and_changes_no_bit(bf16_setup, monkeypatch) -> None:
    trie, model = bf16_setup
    monkeypatch.setattr(LeanLlama, "supported", staticmethod(LeanLlama.supported))
    engine = BeamSearch(EngineModel.build(model), trie, TEXT_VOCAB)
    first = header_prompts(6, seed=11)
    cold = [engine.search(batch([p]), 5) for p in first]  # computes and stores the prefix rows per length
    lean = engine.model.lean()
    assert lean is not None and lean._prefix is not None
    assert lean._prefix.tolist() == HEADER  # learned from the prompts: their longest common prefix
    assert set(lean._prefix_rows) == {len(p) for p in first}
    calls = []
    original = lean._forward
    monkeypatch.setattr(lean, "_forward", lambda *a, **kw: calls.append(kw.get("skip", 0)) or original(*a, **kw))
    warm = [engine.search(batch([p]), 5) for p in first]  # every prefill now skips the header's rows
    together = engine.search(batch(first), 5)  # batched, rows of different lengths, all cached
    assert calls.count(len(HEADER)) == len(first) + 1
    for row, (a, b) in enumerate(zip(cold, warm, strict=True)):
        assert torch.equal(a.leaves, b.leaves) and torch.equal(a.scores, b.scores)
        assert torch.equal(a.leaves[0], together.leaves[row]) and torch.equal(a.scores[0], together.scores[row])
    monkeypatch.setattr(LeanLlama, "supported", staticmethod(lambda m: False))
    for p, a in zip(first, warm, strict=True):  # transformers' own forward gives the same bits
        ref = BeamSearch(EngineModel.build(model), trie, TEXT_VOCAB).search(batch([p]), 5)
        assert torch.equal(ref.leaves, a.leaves) and torch.equal(ref.scores, a.scores)


def test_prompts_without_the_prefix_fall_back_to_the_full_prefill(bf16_setup, monkeypatch) -> None:
    trie, model = bf16_setup
    engine = BeamSearch(EngineModel.build(model), trie, TEXT_VOCAB)
    for p in header_prompts(3, seed=5):
        engine.search(batch([p]), 3)
    other = [[3, 4] + header_prompts(1, seed=6)[0]]
    got = engine.search(batch(other), 3)
    lean = engine.model.lean()
    assert lean is not None and lean._prefix is not None and len(lean._prefix) < lean_mod.MIN_PREFIX
    monkeypatch.setattr(LeanLlama, "supported", staticmethod(lambda m: False))
    ref = BeamSearch(EngineModel.build(model), trie, TEXT_VOCAB).search(batch(other), 3)
    assert torch.equal(ref.leaves, got.leaves) and torch.equal(ref.scores, got.scores)


def test_weights_changed_in_place_rebuild_the_fused_copies(bf16_setup, monkeypatch) -> None:
    trie, model = bf16_setup
    prompts = header_prompts(2, seed=8)
    engine = BeamSearch(EngineModel.build(model), trie, TEXT_VOCAB)
    engine.search(batch(prompts), 4)
    before = engine.model.lean()
    with torch.no_grad():  # what an optimizer step does between validations
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
    fast = engine.search(batch(prompts), 4)
    assert engine.model.lean() is not before
    slow = search(model, trie, prompts, 4, lean=False, monkeypatch=monkeypatch)
    assert torch.equal(slow[0], fast.leaves) and torch.equal(slow[1], fast.scores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_packed_projections_return_the_same_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    wq, wk = (torch.randn(n, 96, generator=gen).to(dtype) for n in (96, 48))
    fused = LeanLinear(torch.cat([wq, wk]))
    for m in (1, 3, 10, 64):
        x = torch.randn(2, m, 96, generator=gen).to(dtype)
        out = fused(x)
        assert out.shape == (2, m, 144)
        assert torch.equal(out[..., :96], F.linear(x, wq)) and torch.equal(out[..., 96:], F.linear(x, wk))


def test_lean_cache_exposes_transformers_layout() -> None:
    cache = LeanCache(None)  # type: ignore[arg-type]
    k = torch.randn(2, 3, 5, 4)
    keys, values = cache.append(0, k, k + 1)
    assert keys.shape == (2, 3, 5, 4) and torch.equal(keys, k) and torch.equal(values, k + 1)
    keys, _ = cache.append(0, k[:, :, :2], k[:, :, :2])
    assert keys.shape == (2, 3, 7, 4) and cache.get_seq_length() == 7
    cache.layers[0].keys = keys[:, :, [0, 6]]  # what TreeCache.compact assigns
    assert torch.equal(cache.layers[0].keys, keys[:, :, [0, 6]])


def test_prompt_batch_prefix_rows_need_a_longer_prompt() -> None:
    """A prompt equal to the prefix keeps its last token out of it (its hidden state is the first code's)."""
    model = tiny_llama(L, C, seed=1, hidden=32, dtype=torch.bfloat16)
    ids = random_catalog(50, L, C, seed=1)
    trie = CatalogTrie(ids)
    engine = BeamSearch(EngineModel.build(model), trie, TEXT_VOCAB)
    engine.search(PromptBatch.from_lists([HEADER]), 3)
    lean = engine.model.lean()
    assert lean is not None and lean._prefix is not None and len(lean._prefix) == len(HEADER) - 1
