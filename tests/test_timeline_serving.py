"""An items bundle (bundle.json "architecture": "items": the item-level target of ``recsvc.timeline`` in
BUNDLE/target) served through the same ``Recommender`` contract as a token bundle: its lists are the item-level
target's beam search run by hand (exclusions, the fused prior, the rules' filters and caps), strict and relaxed
requests are decoded plainly with the reason said, the user-state cache keeps timeline states and search outputs
as keyed rows (a repeat runs no forward), a live catalog's items are served, and a real gRPC server built the way
`recsvc serve --bundle` builds it answers Recommend. Tiny real components: a random tiny timeline on the synthetic
split, its random 4-level ids."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from catalog_fixtures import NEW, add_entry, free_codes
from test_timeline_search import tiny_catalog, tiny_model
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401 (one_thread: a fixture)

from recsvc.bundle.directory import Bundle
from recsvc.bundle.serving_files import write_serving_files
from recsvc.catalog.file import parse_catalog
from recsvc.client.client import RecClient
from recsvc.data.split import load_split_dir
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.errors import UserError
from recsvc.priors.transition import PriorSettings, TransitionPrior
from recsvc.recommender.api import RecQuery, RecResult
from recsvc.recommender.bundle_recommender import BundleRecommender, state_cache_for
from recsvc.recommender.live_catalog import LiveRecommender
from recsvc.recommender.stages.timeline_decode import WHY_PLAIN
from recsvc.rules.attributes import ItemAttributes
from recsvc.rules.spec import Cap, Rules, ValueFilter
from recsvc.service.startup.settings import ServeSettings, build_recommender
from recsvc.timeline.config import TimelineConfig
from recsvc.timeline.model import TimelineModel
from recsvc.timeline.search import beam_search, user_states
from recsvc.timeline.serving import load_timeline
from tokenizer_rqvae.ids import SemanticIds
from tokenizer_rqvae.trie import CatalogTrie

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTH, K = 20, 10
LEVELS = 4  # the random ids' levels: the decoder's calls per search


def make_items_bundle(root: Path, n_users: int = 40) -> Path:
    """A bundle of the synthetic split with random ids, a random tiny item-level target (hidden 16) in
    BUNDLE/target, item attributes (brand) and its serving files; architecture "items"."""
    data = make_data(root, n_users=n_users)
    bundle = Bundle.create(root / "b", data=data)
    bundle.ids_dir.mkdir(parents=True, exist_ok=True)
    write_ids(data, bundle.semantic_ids_path)
    ids = bundle.load_ids()
    torch.manual_seed(0)
    model = TimelineModel(TimelineConfig(levels=ids.levels, codebook_size=ids.codebook_size, hidden=16, layers=2,
                                         heads=2, ffn=32, max_items=8, dropout=0.0))
    with torch.no_grad():  # sharper than the initialisation: the users' rankings differ
        model.heads.mul_(8.0)
    model.save(bundle.target_dir)
    bundle.update(architecture="items")
    for stage in ("ids", "target"):
        bundle.mark_done(stage)
    items = ids.item_ids.tolist()
    ItemAttributes.from_items({i: {"brand": "acme" if i % 2 else "kirra"} for i in items}).save(
        bundle.root / "attributes.json")
    write_serving_files(bundle.root, load_split_dir(data))
    return bundle.root


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return make_items_bundle(tmp_path_factory.mktemp("items"))


@pytest.fixture(scope="module")
def prior_bundle(bundle, tmp_path_factory) -> Path:
    """The items bundle with a fused transition prior (BUNDLE/prior, weight 0.5)."""
    root = tmp_path_factory.mktemp("items-prior") / "b"
    shutil.copytree(bundle, root)
    b = Bundle.open(root)
    data = load_split_dir(b.resolve_data_dir())
    TransitionPrior.fit(data.train.values(), b.load_ids().item_ids.tolist(), PriorSettings(weight=0.5)).save(
        b.prior_dir)
    return root


@pytest.fixture(scope="module")
def rec(bundle) -> BundleRecommender:
    return BundleRecommender.from_bundle(bundle, dtype="fp32", beam_width=WIDTH)


def histories(bundle: Path, n: int = 5) -> list[list[int]]:
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    return [u.history[-10:] for u in data.eval_users("valid")[:n]]


def by_hand(rec: BundleRecommender, hist: list[list[int]], excluded: list[list[int]] | None = None,
            prior: torch.Tensor | None = None, k: int = K) -> list[tuple[list[int], list[float]]]:
    """The item-level target's search run directly (the bundle's model reloaded, the ids' own trie): each
    history's first k items of WIDTH beams and their scores."""
    bundle = rec.parts.bundle
    model, trie = TimelineModel.load(bundle.target_dir), CatalogTrie(bundle.load_ids())
    excluded = excluded or [[] for _ in hist]
    dead = trie.dead_nodes(excluded) if any(excluded) else None
    out = beam_search(model, trie, user_states(model, trie, hist), WIDTH, dead, prior)
    lists = []
    for r in range(len(hist)):
        ok = [j for j, leaf in enumerate(out.leaves[r].tolist()) if leaf >= 0][:k]
        leaves = [int(out.leaves[r, j]) for j in ok]
        lists.append((trie.items_of_leaves(leaves, excluded[r]), [float(out.scores[r, j]) for j in ok]))
    return lists


def lists(results: list[RecResult]) -> list[tuple[list[int], list[float]]]:
    return [(r.item_ids, r.scores) for r in results]


def assert_same_lists(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> None:
    assert [items for items, _ in got] == [items for items, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


# ---- the user-state cache's keyed rows ------------------------------------------------------------------------
def test_keyed_rows_are_lru_in_the_budget_and_counted() -> None:
    cache = UserStateCache(budget_bytes=3 * 64, version="v")
    cache.keep_row(("a",), torch.zeros(16))  # 64 bytes
    cache.keep_row(("b",), torch.zeros(16))
    assert cache.row(("a",)) is not None and cache.row(("c",)) is None
    cache.keep_row(("c",), torch.zeros(16))
    cache.keep_row(("d",), (torch.zeros(8), torch.zeros(8)))  # a tuple: 64 bytes in all, over the budget:
    assert cache.row(("b",), count=False) is None  # the least recently used row ("b") went
    assert cache.row(("a",), count=False) is not None  # not counted: work ahead of a request
    assert isinstance(cache.row(("d",), count=False), tuple)
    cache.keep_row(("huge",), torch.zeros(1000))  # larger than the whole budget: not kept, nothing evicted
    assert cache.row(("huge",), count=False) is None and cache.row(("d",), count=False) is not None
    stats = cache.stats()
    assert (stats["row_hits"], stats["row_misses"], stats["rows"], stats["row_bytes"]) == (1, 1, 3, 3 * 64)
    assert stats["bytes"] == 0 and stats["entries"] == 0  # the prompt states' counters: none
    cache.keep_prior(("p",), torch.zeros(4))  # no room left: prior rows give way to keyed rows
    assert cache.prior(("p",)) is None and cache.stats()["rows"] == 3
    assert UserStateCache(3 * 64, version="other").row(("a",)) is None  # another bundle version
    cache.clear()
    assert cache.row(("a",)) is None and cache.stats()["row_bytes"] == 0


# ---- loading ----------------------------------------------------------------------------------------------------
def test_an_items_bundle_loads_its_timeline_and_no_token_parts(bundle, rec) -> None:
    assert Bundle.open(bundle).architecture == "items"
    assert rec.timeline is not None and rec.target is None and rec.prompts is None and rec.engine is None
    assert rec.drafter is None and rec.dense is None and rec.parts.timeline_ids is rec.ids
    assert rec.max_history == rec.timeline.config.max_items == 8
    facts = rec.facts
    assert facts.precision == "fp32" and not facts.drafter_loaded and facts.beam_width == WIDTH
    assert BundleRecommender.from_bundle(bundle, dtype="bf16").facts.precision == "bf16"
    with pytest.raises(UserError, match="item-level target .* has no drafter"):
        BundleRecommender.from_bundle(bundle, dtype="fp32", drafter_name="llama")
    with pytest.raises(UserError, match="served on the CPU only"):
        load_timeline(Bundle.open(bundle).target_dir, device="cuda")
    assert state_cache_for(rec.target, 0) is None and state_cache_for(rec.target, 1 << 20) is not None


# ---- decoding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exclude_history", [False, True])
def test_lists_are_the_item_level_targets_beam_search(bundle, rec, exclude_history) -> None:
    hist = histories(bundle)
    queries = [RecQuery(history=h, k=K, mode="plain", exclude_history=exclude_history) for h in hist]
    got = rec.recommend(queries)
    assert_same_lists(lists(got), by_hand(rec, hist, hist if exclude_history else None))
    for res, h in zip(got, hist, strict=True):
        assert len(res.item_ids) == K and res.decoding.mode == "plain" and res.decoding.beam_width == WIDTH
        assert res.stats.target_calls == LEVELS + 1  # the decoder's L calls and the timeline's one
        assert not exclude_history or not set(res.item_ids) & set(h)
    # a shorter list is the head of the longer one (the same WIDTH beams)
    (five,) = rec.recommend([RecQuery(history=hist[0], k=5, exclude_history=exclude_history)])
    assert five.item_ids == got[0].item_ids[:5]


def test_the_fused_prior_is_the_search_given_the_prior(prior_bundle) -> None:
    rec = BundleRecommender.from_bundle(prior_bundle, dtype="fp32", beam_width=WIDTH)
    assert rec.prior is not None and rec.prior_weight == 0.5 and not rec.prior_ranks
    hist = histories(prior_bundle)
    got = rec.recommend([RecQuery(history=h, k=K) for h in hist])
    prior = prior_log_mass(CatalogTrie(rec.ids), rec.prior.probs(hist), rec.prior_weight)
    assert_same_lists(lists(got), by_hand(rec, hist, prior=prior))
    unfused = BundleRecommender.from_bundle(prior_bundle, dtype="fp32", beam_width=WIDTH, use_prior=False)
    assert lists(unfused.recommend([RecQuery(history=h, k=K) for h in hist])) != lists(got)


def test_strict_and_relaxed_requests_are_decoded_plainly_and_say_why(bundle, rec) -> None:
    h = histories(bundle, 1)[0]
    plain, strict, relaxed = rec.recommend([RecQuery(history=h, k=K, mode=m, seed=1)
                                            for m in ("plain", "strict", "relaxed")])
    assert plain.decoding.fallback == ""
    for res, mode in ((strict, "strict"), (relaxed, "relaxed")):
        assert res.item_ids == plain.item_ids and res.scores == plain.scores
        assert res.decoding.mode == "plain" and res.decoding.fallback == WHY_PLAIN[mode]


def test_a_repeat_is_served_from_the_state_cache(bundle, rec) -> None:
    cached = rec.variant(states=state_cache_for(rec.target, 16 << 20, "v"))
    assert cached.states is not None
    hist = histories(bundle, 3)
    queries = [RecQuery(history=h, k=K) for h in hist]
    first = cached.recommend(queries)
    again = cached.recommend(queries)
    assert lists(again) == lists(first) and all(r.stats.target_calls == 0 for r in again)
    assert all(r.stats.target_calls == LEVELS + 1 for r in first)
    assert_same_lists(lists(first), lists(rec.recommend(queries)))  # cached and cold: the same lists
    alone = [cached.recommend([q])[0] for q in queries]  # alone, as a batch of one: the kept outputs
    assert lists(alone) == lists(first) and all(r.stats.target_calls == 0 for r in alone)
    (shorter,) = cached.recommend([RecQuery(history=hist[0], k=3)])  # the same WIDTH beams: kept
    assert shorter.item_ids == first[0].item_ids[:3] and shorter.stats.target_calls == 0
    # other exclusions: a new search over the kept timeline state (the decoder's calls only)
    (other,) = cached.recommend([RecQuery(history=hist[0], k=K, exclude=(first[0].item_ids[0],))])
    assert other.stats.target_calls == LEVELS
    assert_same_lists(lists([other]), by_hand(rec, hist[:1], [[first[0].item_ids[0]]]))
    stats = cached.states.stats()
    assert stats["row_hits"] >= 2 * len(queries) + 2 and stats["rows"] > 0 and stats["hits"] == 0


def test_prefill_ahead_keeps_the_next_request(bundle, rec) -> None:
    ahead = rec.variant(states=state_cache_for(rec.target, 16 << 20, "v"), prefill_ahead=True)
    assert ahead.prefill_ahead_enabled
    h = histories(bundle, 1)[0]
    ahead.prefill_ahead(h)
    assert ahead.states.stats()["row_misses"] == 0 and ahead.states.stats()["rows"] == 2  # state, search
    (res,) = ahead.recommend([RecQuery(history=h, k=K)])
    assert res.stats.target_calls == 0 and lists([res]) == lists(rec.recommend([RecQuery(history=h, k=K)]))
    assert ahead.warm_up() >= 0 and ahead.states.stats()["rows"] == 2  # warm-up keeps no user state


def test_rules_filters_are_dead_nodes_and_caps_a_greedy_pick_over_a_wide_search(bundle, rec) -> None:
    brand = {i: "acme" if i % 2 else "kirra" for i in rec.ids.item_ids.tolist()}
    h = histories(bundle, 1)[0]
    deny = Rules(deny=(ValueFilter("brand", frozenset({"acme"})),))
    capped = Rules(caps=(Cap("brand", 3),))
    denied, capped_res = rec.recommend([RecQuery(history=h, k=K, rules=deny),
                                        RecQuery(history=h, k=5, rules=capped)])
    acme = [i for i, b in brand.items() if b == "acme"]
    assert_same_lists(lists([denied]), by_hand(rec, [h], [acme]))  # the filtered items as exclusions
    assert len(denied.item_ids) == K and all(brand[i] == "kirra" for i in denied.item_ids)
    # caps: RULES_WIDTH x k = 20 beams searched, then the greedy pick in score order
    ((wide, wide_scores),) = by_hand(rec, [h], k=WIDTH)
    taken: Counter[str] = Counter()
    want = []
    for item, score in zip(wide, wide_scores, strict=True):
        if taken[brand[item]] < 3 and len(want) < 5:
            taken[brand[item]] += 1
            want.append((item, score))
    assert capped_res.item_ids == [i for i, _ in want] and capped_res.decoding.beam_width == WIDTH
    assert capped_res.scores == pytest.approx([s for _, s in want], abs=1e-5)
    assert max(Counter(brand[i] for i in capped_res.item_ids).values()) <= 3


def test_a_live_catalogs_items_are_served(rec) -> None:
    live = LiveRecommender(rec)
    ids = rec.ids
    codes = free_codes(ids, 2)
    cat = parse_catalog({"version": 1, "add": [add_entry(NEW, codes[0], [0.0]), add_entry(NEW + 1, codes[1],
                                                                                          [1.0])]}, ids)
    live.apply(cat)
    served = live.state.recommender
    assert served.timeline is rec.timeline and served.parts.timeline_ids is rec.ids and len(served.ids) == len(ids) + 2
    only_new = RecQuery(history=[NEW, 1], k=2, exclude=tuple(ids.item_ids.tolist()))
    (res,) = live.recommend([only_new])
    assert sorted(res.item_ids) == [NEW, NEW + 1]  # reached through the new trie; a history with a new item
    h = ids.item_ids[:4].tolist() + [NEW]
    (got,) = live.recommend([RecQuery(history=h, k=K)])
    model, trie = rec.timeline, CatalogTrie(cat.merged_ids(ids))
    out = beam_search(model, trie, user_states(model, trie, [h]), WIDTH)
    assert got.item_ids == trie.items_of_leaves(out.leaves[0, :K].tolist())
    live.apply(parse_catalog({"version": 2, "add": cat.to_json()["add"], "retire": [got.item_ids[0]]}, ids))
    (after,) = live.recommend([RecQuery(history=h, k=K)])
    retired = [got.item_ids[0]]
    out = beam_search(model, trie, user_states(model, trie, [h]), WIDTH, trie.dead_nodes([retired]))
    assert retired[0] not in after.item_ids and after.item_ids == trie.items_of_leaves(out.leaves[0, :K].tolist())


def test_the_per_item_table_keeps_the_bundles_rows_over_a_live_catalog() -> None:
    """A live catalog's merged ids number rows anew (an added item with a low id shifts every row after it); the
    model's per-item table rows are the ids' it was trained over, the added item reads the "unseen" row 0."""
    trie = tiny_catalog(n=30, levels=3, codebook=6, seed=7)
    ids = trie.ids
    model = tiny_model(trie, 7, num_items=len(ids) + 1)
    new_id = next(i for i in range(1, 1000) if i not in ids)
    assert new_id < int(ids.item_ids.max())
    taken = {tuple(r) for r in ids.codes.tolist()}
    code = next((a, b, c) for a in range(6) for b in range(6) for c in range(6) if (a, b, c) not in taken)
    merged = SemanticIds.from_mapping({**{int(i): tuple(ids.codes_of(int(i))) for i in ids.item_ids}, new_id: code},
                                      codebook_size=6)
    live = CatalogTrie(merged)
    hist = [ids.item_ids[[3, 1, 4, 1, 5]].tolist(), ids.item_ids[[9, 2, 6]].tolist()]
    assert torch.equal(user_states(model, live, hist, ids), user_states(model, trie, hist))
    assert not torch.allclose(user_states(model, live, hist), user_states(model, trie, hist))  # rows shifted
    with_new = [hist[0] + [new_id]]
    rows_zero = user_states(model, live, with_new, ids)
    assert rows_zero.shape == (1, 16) and bool(torch.isfinite(rows_zero).all())


# ---- serving ------------------------------------------------------------------------------------------------------
def test_served_over_grpc_as_recsvc_serve_builds_it(bundle, make_server) -> None:
    events: dict[str, dict] = {}
    settings = ServeSettings.for_bundle(str(bundle), ["--spec", "auto", "--forward", "compiled"])
    served = build_recommender(settings, step=lambda event, level=None, **fields: events.setdefault(event, fields))
    assert "calibrating" not in events and "compiling_forward" not in events
    off = events["speculation_off"]
    assert "item-level target has no drafter" in off["reason"] and "--spec auto" in off["reason"]
    assert off["flags_not_applied"] == ["--forward compiled"] and not off["speculation_calibrated"]
    assert served.states is not None and served.facts.precision in ("fp32", "bf16")
    with pytest.raises(UserError, match="has no drafter"):
        build_recommender(ServeSettings.for_bundle(str(bundle), ["--drafter", "llama"]), step=lambda *a, **f: None)
    server = make_server(served)
    ids = lambda r: [i.item_id for i in r.items]  # noqa: E731
    history = served.popular_items(6)[:4]
    with RecClient(f"127.0.0.1:{server.port}") as client:
        client.record("u1", history)
        plain = client.recommend("u1", k=5, mode="plain")
        strict = client.recommend("u1", k=5, mode="strict")
        direct = client.recommend("u2", history=history, k=5, mode="plain")
        with pytest.raises(grpc.RpcError) as err:
            client.recommend("u3", history=[1, 999_999], k=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "999999" in err.value.details()
    assert len(ids(plain)) == 5 and ids(strict) == ids(plain) == ids(direct)
    assert all(len(i.semantic_id) == LEVELS for i in plain.items)
    assert plain.stats.target_forward_calls in (0, LEVELS + 1)  # 0: the warm-up or prefill kept it
    assert strict.stats.target_forward_calls == 0 and direct.stats.target_forward_calls == 0  # kept searches
    assert "no drafter" in strict.stats.mode_fallback_reason and plain.stats.mode_fallback_reason == ""
    assert ids(plain) == served.recommend([RecQuery(history=history, k=5)])[0].item_ids
    assert np.isfinite([i.score for i in plain.items]).all()
