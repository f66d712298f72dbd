"""The fast forward (recsvc.engine.kernels.fast): transformers' generate up to float rounding, the previous (lean)
forward's results, and strict speculation == plain beam search on it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    TEXT_VOCAB,
    batch,
    common_item_gap,
    engine_codes,
    generate_reference,
    random_catalog,
    random_prompts,
    tiny_llama,
)

from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.caches.prefill import Prefill
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.fast import FastCache
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.speculation.strict.speculative import speculative_search
from recsvc.hardware import native_bf16
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16
TOL = 1e-4  # documented in recsvc/engine/kernels/fast.py: matmuls and masked attention sum in another order


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(400, L, C, 21))
    model = tiny_llama(L, C, 21, hidden=64, layers=2)
    return trie, model


@pytest.mark.parametrize("k", [1, 4, 10])
def test_fast_plain_matches_generate_within_tolerance(setup, k: int) -> None:
    trie, model = setup
    fast = EngineModel.build(model, "fp32")
    assert fast.plan.fast and fast.forward_name == "fast"
    engine = BeamSearch(fast, trie, TEXT_VOCAB)
    for prompt in random_prompts(4, 22, min_len=3, max_len=30):
        out = engine.search(batch([prompt]), k)
        ref_codes, ref_scores = generate_reference(model, trie, prompt, k)
        assert engine_codes(trie, out.leaves)[0] == ref_codes
        torch.testing.assert_close(out.scores[0][: len(ref_scores)], torch.tensor(ref_scores), atol=TOL, rtol=0)


def test_fast_and_lean_agree_and_lean_stays_available(setup) -> None:
    trie, model = setup
    fast, lean = EngineModel.build(model, "fp32"), EngineModel.build(model, "fp32", forward="lean")
    assert not lean.plan.fast and lean.forward_name == "lean"
    prompts = random_prompts(5, 23, min_len=3, max_len=30)
    a = BeamSearch(fast, trie, TEXT_VOCAB).search(batch(prompts), 8)
    b = BeamSearch(lean, trie, TEXT_VOCAB).search(batch(prompts), 8)
    assert torch.equal(a.leaves, b.leaves)
    torch.testing.assert_close(a.scores, b.scores, atol=TOL, rtol=0)
    lean.set_forward("fast")
    assert lean.plan.fast and isinstance(lean.new_cache(), FastCache)
    exact = EngineModel.build(model, "exact")  # the bit-identical mode keeps the lean forward
    assert not exact.plan.fast


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


def _prefill(model: EngineModel, prompts: list[list[int]], prune: bool, states=None):
    pre = Prefill(model, model.new_cache(), batch(prompts), states)
    pre.prune = prune
    last = pre.run()  # [B, H]
    return pre, last, pre.first_logprobs(last, TEXT_VOCAB, C)


def test_pruned_prefill_equals_the_full_last_layer(setup) -> None:
    """The prefill's last layer runs q / attention / MLP on each prompt's last token only: the same last hidden
    state, first-code log-probs and prompt keys / values as the full forward, also when a cached prompt is
    extended (only its new tokens computed) in a batch with a miss and a full hit."""
    _, model = setup
    target = EngineModel.build(model, "fp32")
    prompts = random_prompts(4, 26, min_len=3, max_len=30)
    full, h_full, lp_full = _prefill(target, prompts, prune=False)
    pruned, h_pruned, lp_pruned = _prefill(target, prompts, prune=True)
    assert full.calls == pruned.calls == 1
    torch.testing.assert_close(h_pruned, h_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_pruned, lp_full, atol=1e-5, rtol=0)
    for row, prompt in enumerate(prompts):  # the keys / values later tokens attend to
        for (k1, v1), (k2, v2) in zip(full.cache.rows_of(row, len(prompt)), pruned.cache.rows_of(row, len(prompt)),
                                      strict=True):
            torch.testing.assert_close(k2, k1, atol=1e-6, rtol=0)
            torch.testing.assert_close(v2, v1, atol=1e-6, rtol=0)
    states = UserStateCache(1 << 30)
    pre, h_two, lp_two = _prefill(target, prompts[:2], prune=True, states=states)
    pre.remember(h_two, lp_two)  # prompts 0 and 1 cached
    mixed = [prompts[0] + [5, 6, 7, 8, 9], prompts[1], random_prompts(1, 27, min_len=8, max_len=20)[0]]
    ext_full, h_ext_full, lp_ext_full = _prefill(target, mixed, prune=False, states=states)
    ext, h_ext, lp_ext = _prefill(target, mixed, prune=True, states=states)
    assert ext.cached == ext_full.cached == [len(prompts[0]), len(prompts[1]), 0]  # extension, full hit, miss
    torch.testing.assert_close(h_ext, h_ext_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_ext, lp_ext_full, atol=1e-5, rtol=0)
    _, h_ref, _ = _prefill(target, mixed, prune=True)  # the extension vs the whole prompt computed
    torch.testing.assert_close(h_ext, h_ref, atol=1e-5, rtol=0)


def test_rotary_table_rows_are_the_rotary_modules_bits(setup) -> None:
    """The fast forward indexes a cos / sin table instead of running the rotary module per forward: its rows
    are the module's very bits for any batch of positions; past the table the module runs (same bits)."""
    _, model = setup
    fast = EngineModel.build(model, attention="fp32").fast()
    assert fast.rotary_table is not None
    n = fast.rotary_table[0].shape[0]
    gen = torch.Generator().manual_seed(3)
    for pos in (torch.randint(0, n, (5, 9), generator=gen), torch.arange(7)[None] + 11, torch.zeros(2, 0).long()):
        x = torch.zeros(*pos.shape, model.config.hidden_size)
        want, got = fast.rotary(x, pos), fast._cos_sin(x, pos)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    beyond = torch.arange(3)[None] + n
    x = torch.zeros(1, 3, model.config.hidden_size)
    assert all(torch.equal(w, g) for w, g in zip(fast.rotary(x, beyond), fast._cos_sin(x, beyond), strict=True))


def test_fast_forward_rebuilt_once_after_an_in_place_update() -> None:
    model = tiny_llama(L, C, 21, hidden=64, layers=2)
    engine = EngineModel.build(model, attention="fp32")
    first = engine.fast()
    assert engine.fast() is first  # unchanged parameters: the same fused copies
    down = model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        down.mul_(2.0)  # training's in-place step
    second = engine.fast()
    assert second is not first and engine.fast() is second  # rebuilt once, then kept
    x = torch.randn(3, down.shape[1], generator=torch.Generator().manual_seed(0))
    assert torch.allclose(second.layers[0][7](x), x @ down.detach().T, atol=1e-5)  # the new weights


BF16_TOL = 0.25  # documented in recsvc/engine/kernels/fast.py: bf16 activations round at ~3 significant digits


def test_bf16_fast_forward_is_as_close_to_fp32_as_the_lean_bf16_path(setup) -> None:
    """A bf16 model runs the fast forward too (packed bf16 weights, fp32 attention). bf16 rounding reorders
    near-ties, so the contract is statistical: on the items both return, its scores are the lean bf16 path's
    within bf16 rounding, and it agrees with the fp32 model as often as the lean bf16 path does."""
    import copy

    trie, model = setup
    half = copy.deepcopy(model).to(torch.bfloat16)
    fast, lean = EngineModel.build(half, "fp32"), EngineModel.build(half, "fp32", forward="lean")
    assert fast.plan.fast and fast.forward_name == "fast" and isinstance(fast.new_cache(), FastCache)
    if native_bf16():  # oneDNN packs bf16 weights where the CPU computes in bf16 (row-independent: probed)
        assert fast.fast().layers[0][2].packed is not None
    reference = EngineModel.build(model, "fp32")
    prompts = batch(random_prompts(8, 23, min_len=3, max_len=30))
    a, b, ref = (BeamSearch(m, trie, TEXT_VOCAB).search(prompts, 8) for m in (fast, lean, reference))
    gap, shared = common_item_gap(a, b)
    assert shared >= 0.8 * a.leaves.numel() and gap <= BF16_TOL
    agree_fast = float((a.leaves == ref.leaves).float().mean())
    agree_lean = float((b.leaves == ref.leaves).float().mean())
    assert agree_fast >= agree_lean - 0.1


def test_bf16_user_state_cache_returns_what_it_returns_without(setup) -> None:
    """Packed bf16 linears are row-independent (probed), so a cached prompt gives the very results."""
    import copy

    trie, model = setup
    fast = EngineModel.build(copy.deepcopy(model).to(torch.bfloat16), "fp32")
    engine = BeamSearch(fast, trie, TEXT_VOCAB)
    states = UserStateCache(1 << 30)
    for prompt in random_prompts(3, 24, min_len=3, max_len=30):
        ref = engine.search(batch([prompt]), 5)
        first, again = (engine.search(batch([prompt]), 5, states=states) for _ in range(2))
        assert torch.equal(first.leaves, ref.leaves) and torch.equal(first.scores, ref.scores)
        assert torch.equal(again.leaves, ref.leaves) and torch.equal(again.scores, ref.scores)
        assert again.target_calls == 0


@pytest.mark.parametrize("fp32", [True, False])
def test_a_decode_steps_direct_mask_is_the_tree_mask_of_its_groups(setup, fp32: bool) -> None:
    """``BeamCache._mask`` (what the fast forward's decode steps attend) equals ``tree_mask`` of the step's key
    groups (``_groups``: split per request in fp32, grouped by prompt length otherwise), over prompts of unequal
    lengths and three steps of beams with random parents."""
    from recsvc.engine.caches.beam_cache import BeamCache
    from recsvc.engine.kernels.engine_model import tree_mask

    trie, model = setup
    cache = BeamCache(EngineModel.build(model, "fp32"), trie, TEXT_VOCAB,
                      batch(random_prompts(3, 40, min_len=3, max_len=30)))
    cache.fp32, cache.width = fp32, cache.prompts.width + 1
    gen = torch.Generator().manual_seed(41)
    k = 5
    nodes = torch.randint(1, int(trie.children.shape[0]), (3, k), generator=gen)
    for _ in range(3):
        parents = torch.randint(0, k, (3, k), generator=gen)
        path, _, _ = cache._step_inputs(nodes, parents)
        slots, visible = cache._mask(path)
        want_slots, want_visible = tree_mask(cache.width, nodes.shape, cache._groups(path))
        assert torch.equal(slots, want_slots) and torch.equal(visible, want_visible)
        cache.path, cache.width = path, cache.width + k


@pytest.mark.parametrize("forward", ["fast", "bucketed"])
def test_a_finished_search_frees_its_keys_and_values_without_the_cyclic_collector(setup, forward: str) -> None:
    """Cache layers hold their cache weakly: no reference cycle keeps a search's KV buffers (or, once
    ``gc.freeze`` ran, a retired bundle version's forward) alive after the last reference goes."""
    import gc
    import weakref

    trie, model = setup
    engine = EngineModel.build(model, "fp32", forward=forward)
    search = BeamSearch(engine, trie, TEXT_VOCAB)
    search.search(batch(random_prompts(2, 23)), 4)  # a warm engine (a bucketed one: its pool leased once)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        cache = engine.new_cache()
        cache.reserve(24, 2)
        buffers = [weakref.ref(kv.k) for kv in cache.layers] + [weakref.ref(kv.v) for kv in cache.layers]
        layer = weakref.ref(cache.layers[0])
        assert layer().cache is cache
        del cache
        assert layer() is None  # freed by reference counting alone
        if forward == "fast":  # its own buffers (a bucketed cache's are the engine's pool, kept for the next)
            assert all(b() is None for b in buffers)
    finally:
        if was_enabled:
            gc.enable()
