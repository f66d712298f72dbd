"""List-level rules during decoding, against brute force: on random tiny catalogs with a tiny real transformers
model, every list satisfies the filters and caps, holds exactly k items whenever k compliant items exist, and
reports each item's exact score + boosts, best first (every item's score enumerated over the whole trie)."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsvc.drafters.head_model import DraftHead, HeadConfig
from recsvc.engine.caches.tree_cache import TreeCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import node_logprobs
from recsvc.rule_decoding.lookahead import DraftLookahead, TargetLookahead
from recsvc.rule_decoding.search import item_ids, list_search
from recsvc.rules.attributes import ItemAttributes
from recsvc.rules.catalog import RuleCatalog
from recsvc.rules.spec import Boost, Cap, Rules, ValueFilter
from tokenizer_rqvae.trie import CatalogTrie

L = 4
TOL = 1e-4  # tree-attention scores of two feeding orders differ by float error only


def item_scores(model: EngineModel, trie: CatalogTrie, prompt: list[int]) -> dict[int, float]:
    """Brute force: every catalog item's score (sum of its code log-probs) from one forward over the whole trie."""
    cache = TreeCache(model, trie, TEXT_VOCAB, batch([prompt]))
    internal = torch.arange(trie.num_internal, device=model.device)[None]  # [1, N_int] the root and every prefix
    cache.feed(internal)
    logp = node_logprobs(model, cache, internal)[0]  # [N_int, C]
    codes = torch.as_tensor(np.asarray(trie.ids.codes), device=model.device)  # [n, L]
    trie = trie.to(model.device)
    path = trie.item_path[:, :L]  # [n, L] the node each code is chosen at
    scores = logp[path, codes].sum(1)
    return dict(zip(trie.ids.item_ids.tolist(), scores.tolist(), strict=True))


def random_world(seed: int, codebook: int, n_items: int, n_brands: int, device: str = "cpu"):
    ids = random_catalog(n_items, L, codebook, seed)
    trie = CatalogTrie(ids).to(device)  # the catalog's rules are compiled on the trie's (the model's) device
    rng = np.random.default_rng(seed)
    items = {}
    for item in ids.item_ids.tolist():
        attrs = {"category": f"c{rng.integers(0, 3)}"}
        if rng.random() > 0.1:  # some items have no brand: never capped
            attrs["brand"] = f"b{rng.integers(0, n_brands)}"
        items[item] = attrs
    attrs = ItemAttributes.from_items(items)
    return ids, trie, attrs, RuleCatalog(attrs, trie)


def random_rules(rng: np.random.Generator, n_brands: int) -> Rules:
    caps = (Cap("brand", int(rng.integers(1, 4))),)
    allow = (ValueFilter("category", frozenset({"c0", "c1"})),) if rng.random() < 0.4 else ()
    deny = (ValueFilter("brand", frozenset({f"b{rng.integers(0, n_brands)}"})),) if rng.random() < 0.3 else ()
    boosts = (Boost("brand", f"b{rng.integers(0, n_brands)}", float(rng.choice([0.5, 2.0, -1.0]))),) \
        if rng.random() < 0.5 else ()
    return Rules(caps=caps, allow=allow, deny=deny, boosts=boosts)


def compliant_max(attrs: ItemAttributes, rules: Rules, alive: list[int]) -> int:
    """The largest list the caps allow over the alive items (one cap, single-valued: per value min(count, m))."""
    (cap,) = rules.caps
    counts: dict[str, int] = {}
    free = 0
    for item in alive:
        vals = attrs.values[cap.attribute].get(item, ())
        if vals:
            counts[vals[0]] = counts.get(vals[0], 0) + 1
        else:
            free += 1
    return free + sum(min(c, cap.m) for c in counts.values())


def check_lists(attrs, rules_list, excluded, lists, scores, brute, k) -> None:
    def ok(item: int, rules: Rules, ex: list[int]) -> bool:
        vals = {a: attrs.values[a].get(item, ()) for a in attrs.names}
        return (item not in ex and all(set(vals[f.attribute]) & f.values for f in rules.allow)
                and not any(set(vals[f.attribute]) & f.values for f in rules.deny))

    for rules, ex, items, got, all_scores in zip(rules_list, excluded, lists, scores, brute, strict=True):
        alive = [i for i in all_scores if ok(i, rules, ex)]
        assert len(set(items)) == len(items) and all(ok(i, rules, ex) for i in items)
        for cap in rules.caps:  # 100% compliance
            seen: dict[str, int] = {}
            for item in items:
                for v in attrs.values[cap.attribute].get(item, ()):
                    seen[v] = seen.get(v, 0) + 1
            assert max(seen.values(), default=0) <= cap.m
        assert len(items) == min(k, compliant_max(attrs, rules, alive))  # exactly k whenever k exist
        boost = {i: sum(b.weight for b in rules.boosts if b.value in attrs.values[b.attribute].get(i, ()))
                 for i in items}
        want = [all_scores[i] + boost[i] for i in items]
        np.testing.assert_allclose(got[: len(items)], want, atol=TOL, rtol=0)
        assert all(a >= b - TOL for a, b in zip(got, got[1:], strict=False))  # best first


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    codebook=st.sampled_from([4, 8]),
    n_brands=st.integers(2, 12),
    k=st.integers(1, 12),
    extra=st.sampled_from([0, 3]),
    batch_size=st.integers(1, 3),
    strategy=st.sampled_from(["beam", "cdlh", "cdsl"]),
    verify=st.sampled_from(["beams", "paths"]),
)
def test_lists_comply_and_hold_k_items_whenever_k_exist(device, seed, codebook, n_brands, k, extra, batch_size,
                                                        strategy, verify):
    ids, trie, attrs, catalog = random_world(seed, codebook, 90, n_brands, device)
    llama = tiny_llama(L, codebook, seed, device=device)
    model = EngineModel.build(llama)
    rng = np.random.default_rng(seed + 1)
    prompts = random_prompts(batch_size, seed, min_len=1, max_len=10)
    rules = [random_rules(rng, n_brands) for _ in prompts]
    excluded = [rng.choice(ids.item_ids, size=5, replace=False).tolist() if rng.random() < 0.5 else []
                for _ in prompts]
    compiled = catalog.compile(rules, excluded)
    lookahead = None
    if strategy == "cdlh":
        lookahead = TargetLookahead(model, compiled, None, 2 * k)
    elif strategy == "cdsl":
        head = DraftHead(HeadConfig(hidden=llama.config.hidden_size, levels=L, codebook=codebook))
        head.init_from_lm_head(llama.get_output_embeddings().weight, TEXT_VOCAB)
        lookahead = DraftLookahead(model, head.to(device), compiled, None, 2 * k, verify=verify, corrections=0)
    out = list_search(model, catalog, TEXT_VOCAB, batch(prompts), k, k + extra, compiled, lookahead=lookahead)
    brute = [item_scores(model, trie, p) for p in prompts]
    check_lists(attrs, rules, excluded, item_ids(catalog, out.rows), out.scores.tolist(), brute, k)


def test_cdsl_with_unlimited_corrections_returns_cdlh_lists() -> None:
    # speculation changes the cost of the look-aheads, not their result: the target's greedy completions
    for seed in range(4):
        ids, trie, attrs, catalog = random_world(seed, 8, 120, 5)
        llama = tiny_llama(L, 8, seed)
        model = EngineModel.build(llama)
        prompts = random_prompts(2, seed)
        rules = [Rules(caps=(Cap("brand", 1),)), Rules(caps=(Cap("brand", 2),), boosts=(Boost("brand", "b1", 1.0),))]
        head = DraftHead(HeadConfig(hidden=llama.config.hidden_size, levels=L, codebook=8))
        head.init_from_lm_head(llama.get_output_embeddings().weight, TEXT_VOCAB)
        lists = []
        for kind in ("cdlh", "cdsl"):
            compiled = catalog.compile(rules, [[], []])
            look = (TargetLookahead(model, compiled, None, 12) if kind == "cdlh"
                    else DraftLookahead(model, head, compiled, None, 12, verify="paths", corrections=None))
            out = list_search(model, catalog, TEXT_VOCAB, batch(prompts), 8, 8, compiled, lookahead=look)
            lists.append(item_ids(catalog, out.rows))
        assert lists[0] == lists[1]


def test_looking_ahead_only_where_caps_need_extra_beams_changes_no_list() -> None:
    # the order after the first `width` candidates is read only when the caps keep more beams: skipping the
    # look-ahead elsewhere gives the full look-ahead's lists, scores and kept beams, with fewer roll-outs
    skipped = 0
    for seed in range(6):
        ids, trie, attrs, catalog = random_world(seed, 8, 120, 4 + seed)
        llama = tiny_llama(L, 8, seed)
        model = EngineModel.build(llama)
        prompts = random_prompts(3, seed)
        rules = [Rules(caps=(Cap("brand", 1),)), Rules(caps=(Cap("brand", 3),)),
                 Rules(boosts=(Boost("brand", "b1", 1.0),))]
        head = DraftHead(HeadConfig(hidden=llama.config.hidden_size, levels=L, codebook=8))
        head.init_from_lm_head(llama.get_output_embeddings().weight, TEXT_VOCAB)
        for kind in ("cdlh", "cdsl"):
            outs, looks = [], []
            for always in (True, False):
                compiled = catalog.compile(rules, [[], [], []])
                look = (TargetLookahead(model, compiled, None, 12) if kind == "cdlh"
                        else DraftLookahead(model, head, compiled, None, 12))
                outs.append(list_search(model, catalog, TEXT_VOCAB, batch(prompts), 6, 6, compiled, lookahead=look,
                                        lookahead_always=always))
                looks.append(look)
            assert torch.equal(outs[0].rows, outs[1].rows) and torch.equal(outs[0].beams, outs[1].beams)
            torch.testing.assert_close(outs[0].scores, outs[1].scores, atol=TOL, rtol=0)
            if kind == "cdlh":
                assert looks[1].forwards <= looks[0].forwards
                skipped += looks[0].forwards - looks[1].forwards
    assert skipped > 0  # the skip happened somewhere


@pytest.mark.parametrize("m", [1, 2])
def test_beams_widen_only_when_the_caps_need_it(m) -> None:
    # brand b1 is the catalog's worst-scored item alone, every other item is b0: with m = 1 a list of 2 must
    # reach that item, so the beams widen until they hold it; with m = 2 the first beams hold 2 b0 items
    ids = random_catalog(100, L, 8, 5)
    trie = CatalogTrie(ids)
    model = EngineModel.build(tiny_llama(L, 8, 5))
    prompt = random_prompts(1, 5)[0]
    scores = item_scores(model, trie, prompt)
    worst = min(scores, key=scores.get)
    attrs = ItemAttributes.from_items({i: {"brand": "b1" if i == worst else "b0"} for i in scores})
    catalog = RuleCatalog(attrs, trie)
    compiled = catalog.compile([Rules(caps=(Cap("brand", m),))], [[]])
    out = list_search(model, catalog, TEXT_VOCAB, batch([prompt]), 2, 2, compiled)
    items = item_ids(catalog, out.rows)[0]
    assert len(items) == 2
    if m == 1:
        assert worst in items and int(out.beams.max()) > 2
    else:
        assert worst not in items and out.beams.tolist() == [[2, 2, 2]]


@pytest.mark.parametrize("module", ["spec", "derive", "build", "greedy"])
def test_docstring_examples(module) -> None:
    result = doctest.testmod(importlib.import_module(f"recsvc.rules.{module}"))
    assert result.attempted > 0 and result.failed == 0
