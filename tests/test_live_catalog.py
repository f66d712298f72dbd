"""The live catalog without a server: the file's validation and atomic writes, the prior extended with new items,
and a bundle's recommender over added / retired items (LiveRecommender) on a tiny real bundle."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from catalog_fixtures import DIM, NEW, add_entry, free_codes, live_bundle, vector_of
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.catalog.file import LiveCatalog, parse_catalog, read_catalog
from recsvc.errors import UserError
from recsvc.priors.transition import PriorSettings, TransitionPrior
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender, state_cache_for
from recsvc.recommender.live_catalog import LiveRecommender, with_catalog
from recsvc.rules.spec import Cap, Rules, ValueFilter
from tokenizer_rqvae.ids import SemanticIds

BASE = SemanticIds.from_mapping({1: (0, 0, 0, 1), 2: (0, 0, 0, 2), 5: (3, 1, 4, 1)})


def doc(add=(), retire=(), version=1) -> dict:
    return {"version": version, "add": list(add), "retire": list(retire)}


def test_a_valid_document_merges_with_the_bundle_ids(tmp_path: Path) -> None:
    cat = parse_catalog(doc([add_entry(4, [0, 0, 1, 0], [1.0, 0.0]), add_entry(3, [9, 9, 9, 9], [0, 2])],
                            retire=[5, 3]), BASE, 2)
    assert cat.item_ids.tolist() == [3, 4] and cat.codes.tolist() == [[9, 9, 9, 9], [0, 0, 1, 0]]
    assert cat.vectors.shape == (2, 2) and cat.retired.tolist() == [3, 5]
    merged = cat.merged_ids(BASE)
    assert merged.item_ids.tolist() == [1, 2, 3, 4, 5] and merged.codes_of(4) == (0, 0, 1, 0)
    assert merged.codes_of(5) == (3, 1, 4, 1) and merged.collisions() == 0
    cat.save(tmp_path / "c.json")  # round trip, and no temp file left behind
    again = read_catalog(tmp_path / "c.json", BASE, 2)
    assert again.item_ids.tolist() == [3, 4] and np.allclose(again.vectors, cat.vectors)
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]
    assert parse_catalog({}, BASE).merged_ids(BASE) is BASE  # an empty catalog: the bundle's own


@pytest.mark.parametrize(("document", "message"), [
    ([1, 2], "expected a JSON object"),
    ({"version": 1, "adds": []}, "unknown field(s) 'adds'"),
    (doc(version=-1), "version must be an integer >= 0"),
    (doc([add_entry(7, [0, 0, 0, 1], [1.0, 0.0])]), "add[0].codes: [0, 0, 0, 1] is already item 1's id"),
    (doc([add_entry(7, [1, 1, 1, 1], [1, 0]), add_entry(8, [1, 1, 1, 1], [0, 1])]), "is already item 7's id"),
    (doc([add_entry(2, [1, 1, 1, 1], [1, 0])]), "item 2 is already in the bundle's catalog"),
    (doc([add_entry(7, [1, 1, 1], [1, 0])]), "add[0].codes must be a list of 4 codes"),
    (doc([add_entry(7, [1, 1, 1, 256], [1, 0])]), "codes must lie in [0, 256)"),
    (doc([add_entry(7, [1, 1, 1, "2"], [1, 0])]), "add[0].codes must be an integer"),
    (doc([add_entry(7, [1, 1, 1, 2], [1, 0, 0])]), "add[0].vector has 3 dimensions, the served item embeddings have 2"),
    (doc([add_entry(7, [1, 1, 1, 2], [1, float("nan")])]), "add[0].vector must be a non-empty list of finite"),
    (doc([{"item_id": 7, "codes": [1, 1, 1, 2]}]), "exactly item_id, codes and vector"),
    (doc([add_entry(0, [1, 1, 1, 2], [1, 0])]), "add[0].item_id must be an integer >= 1"),
    (doc(retire=[99]), "retire[0]: item 99 is in neither the bundle's catalog nor add"),
    (doc(retire=[1, 1]), "retire[1]: item 1 is retired twice"),
])
def test_malformed_documents_are_rejected_with_the_field_named(document, message) -> None:
    with pytest.raises(UserError) as err:
        parse_catalog(document, BASE, 2)
    assert message in str(err.value), str(err.value)


def test_read_catalog_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "catalog_live.json"
    bad.write_text('{"version": 1, "add": [')
    with pytest.raises(UserError, match="catalog_live.json: not a readable JSON file"):
        read_catalog(bad, BASE)
    bad.write_text(json.dumps(doc(retire=[42])))
    with pytest.raises(UserError, match=r"catalog_live.json: retire\[0\]: item 42"):
        read_catalog(bad, BASE)


def test_the_extended_prior_is_the_prior_fitted_over_the_larger_catalog() -> None:
    """New items get zero counts: extending a fitted prior equals fitting it over the catalog with them."""
    seqs = [[1, 2, 5, 2], [5, 1, 2], [2, 5]]
    settings = PriorSettings(window=2, beta=0.5)
    grown = TransitionPrior.fit(seqs, [1, 2, 5], settings).with_items([3, 9, 2])
    direct = TransitionPrior.fit(seqs, [1, 2, 3, 5, 9], settings)
    for name in ("item_ids", "indptr", "indices", "counts", "item_counts"):
        assert np.array_equal(getattr(grown, name), getattr(direct, name)), name
    hist = [[5, 1], [3], []]
    assert np.allclose(grown.probs(hist), direct.probs(hist))
    p = grown.probs([[1]])[0]  # a new item: the back-off mass only, below every item seen after 1
    assert 0 < p[2] < p[1] and grown.with_items([1, 2]) is grown


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return live_bundle(tmp_path_factory.mktemp("live"))


@pytest.fixture(scope="module", params=["default", "transition"])
def base(bundle, request, one_thread) -> BundleRecommender:  # noqa: F811
    """The bundle's recommender with its LLaMA drafter, or with the transition drafter (it holds a prior)."""
    name = None if request.param == "default" else "transition"
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", drafter_name=name)
    assert rec.prior_weight > 0 and rec.fresh is not None and rec.attributes is not None
    return rec


def test_added_items_are_decoded_and_take_the_fresh_slot_retired_ones_never_return(bundle, base) -> None:
    live = LiveRecommender(base)
    ids = base.ids
    history = ids.item_ids[:3].tolist()
    queries = [RecQuery(history=history, k=5, mode=m, seed=1) for m in ("plain", "strict", "relaxed")]
    before = [r.item_ids for r in live.recommend(queries)]
    before_base = [r.item_ids for r in base.recommend(queries)]
    assert before == before_base  # no catalog file: the bundle's recommender exactly
    codes = free_codes(ids, 2)
    # item NEW copies the last history item's text vector: it is the user's best fresh match
    cat = parse_catalog(doc([add_entry(NEW, codes[0], vector_of(bundle, history[-1])),
                             add_entry(NEW + 1, codes[1], [1.0] + [0.0] * (DIM - 1))]), ids, DIM)
    state = live.apply(cat)
    assert state.items == len(ids) + 2 and live.known_item(NEW) and live.semantic_id(NEW)[0] == f"<a_{codes[0][0]}>"
    after = live.recommend(queries)
    for res in after[:2]:  # plain and strict: the model's head, the fresh tail slot to the new item
        assert res.item_ids[-1] == NEW and res.fresh == 1 and res.scores[-1] == pytest.approx(1.0, abs=1e-4)
    # the trie holds the new ids: a history of new items decodes, and excluding all but the new items
    # leaves only them to decode (the engine reaches them through the trie)
    only_new = RecQuery(history=[NEW], k=2, mode="plain", exclude=tuple(ids.item_ids.tolist()))
    (res,) = live.recommend([only_new])
    assert sorted(res.item_ids) == [NEW, NEW + 1]
    assert live.popular_items(len(ids) + 2)[-2:] == [NEW, NEW + 1]  # nobody has interacted with them yet
    # retire the model's first item of every mode: gone from every list, the fresh tail and the fallback
    top = {r.item_ids[0] for r in after}
    cat2 = parse_catalog(doc(cat.to_json()["add"], retire=sorted(top) + [NEW], version=2), ids, DIM)
    grown = live.state.recommender
    assert live.apply(cat2).recommender is grown  # only retirements changed: nothing rebuilt
    for res in live.recommend(queries + [RecQuery(history=history, k=5, mode="plain", rules=Rules(
            caps=(Cap("brand", 3),)))]):
        assert not (set(res.item_ids) & (top | {NEW})) and len(res.item_ids) == 5
    assert not set(live.popular_items(len(ids) + 2)) & (top | {NEW})
    # the bundle's recommender (what a batch started before the swap holds) is unchanged
    assert [r.item_ids for r in base.recommend(queries)] == before_base
    assert live.base is base and with_catalog(base, LiveCatalog.empty()) is base


def test_a_drafter_follows_the_catalog(base) -> None:
    """Strict decoding of a history holding a new item: the drafter drafts over the new trie (its prior too)."""
    ids = base.ids
    code = free_codes(ids, 1, seed=3)[0]
    rec = with_catalog(base, parse_catalog(doc([add_entry(NEW, code, [0.5] * DIM)]), ids, DIM))
    assert rec.drafter is not base.drafter and rec.drafter.trie is rec.trie and base.drafter.trie is base.trie
    queries = [RecQuery(history=[1, NEW], k=5, mode=m) for m in ("plain", "strict")]
    plain, strict = rec.recommend(queries)
    assert plain.item_ids == strict.item_ids  # strict verification stays lossless over the new trie
    assert NEW not in base.ids and NEW not in base.prompts.ids and base.trie.ids is base.ids  # base untouched


def test_rules_see_new_items_once_the_attributes_file_lists_them(bundle, tmp_path) -> None:
    """The attributes file is re-read over the live trie, and a later catalog update keeps what it re-read."""
    path = tmp_path / "attributes.json"
    path.write_text((bundle / "attributes.json").read_text())
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", use_drafter=False, attributes=path)
    live = LiveRecommender(rec)
    codes = free_codes(rec.ids, 2, seed=5)
    first = [add_entry(NEW, codes[0], [0.1] * DIM)]
    live.apply(parse_catalog(doc(first), rec.ids, DIM))
    live.state.recommender.attributes.check_every_s = 0.0
    attrs = json.loads(path.read_text())
    attrs["items"][str(NEW)] = {"brand": "zeta"}
    path.write_text(json.dumps(attrs))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on a coarse clock
    zeta = Rules(allow=(ValueFilter("brand", frozenset({"zeta"})),))
    (res,) = live.recommend([RecQuery(history=[1, 2], k=3, mode="plain", rules=zeta)])
    assert res.item_ids == [NEW]  # the only item with that brand: reached through the new trie
    live.state.recommender.attributes.check_every_s = 3600.0  # no further reload: what the update carries over
    live.apply(parse_catalog(doc(first + [add_entry(NEW + 1, codes[1], [0.1] * DIM)], version=2), rec.ids, DIM))
    (res,) = live.recommend([RecQuery(history=[1, 2], k=3, mode="plain", rules=zeta)])
    assert res.item_ids == [NEW] and "zeta" in live.rule_catalog.index["brand"].vocab


def test_the_user_state_cache_never_replays_steps_of_another_catalog(bundle) -> None:
    """The cache keeps decode steps by trie node ids, which a new trie numbers anew: each catalog state gets
    its own cache (the same budget), and the one swapped out is emptied."""
    loaded = BundleRecommender.from_bundle(bundle, dtype="fp32", use_drafter=False, use_prior=False)
    cached = loaded.variant(states=state_cache_for(loaded.target, 64 << 20, "v"))
    if cached.states is None:
        pytest.skip("the user-state cache needs the fast forward")
    plain = BundleRecommender.from_bundle(bundle, dtype="fp32", use_drafter=False, use_prior=False)
    live = LiveRecommender(cached)
    ids = cached.ids
    queries = [RecQuery(history=ids.item_ids[i : i + 4].tolist(), k=5, mode="plain") for i in (0, 9, 20)]
    for _ in range(2):  # the second pass replays the kept steps
        assert [r.item_ids for r in live.recommend(queries)] == [r.item_ids for r in plain.recommend(queries)]
    assert cached.states.stats()["hits"] > 0
    # new items whose ids sort first: every trie node is numbered anew
    codes = [[0, 0, 0, c] for c in range(3) if (0, 0, 0, c) not in {tuple(r) for r in ids.codes.tolist()}]
    cat = parse_catalog(doc([add_entry(NEW + n, c, [0.1] * DIM) for n, c in enumerate(codes)]), ids, DIM)
    live.apply(cat)
    expected = with_catalog(plain, cat)
    for _ in range(2):
        got = live.recommend(queries)
        want = expected.recommend(queries)
        assert [(r.item_ids, r.scores) for r in got] == [(r.item_ids, r.scores) for r in want]
    assert live.states is not cached.states and live.states.budget == cached.states.budget
    assert cached.states.stats()["entries"] == 0  # the state swapped out holds nothing
