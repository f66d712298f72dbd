"""The user-state cache: a cached prompt is not run again, and the results do not change."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from engine_helpers import TEXT_VOCAB, batch, random_catalog, random_prompts, tiny_llama
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle

from recsvc.client.client import RecClient
from recsvc.drafters.llama import LlamaDrafter
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.engine.search.sampling import make_generators, sampling_beam_search
from recsvc.engine.speculation.strict.speculative import speculative_search
from tokenizer_rqvae.trie import CatalogTrie

L, C = 4, 16
PARTIAL_TOL = 1e-4  # a partial hit runs the new tokens in their own call: float rounding only


def _kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(2, tokens, 4), torch.zeros(2, tokens, 4))]


def test_lookup_full_partial_miss_and_lru_budget() -> None:
    one = 2 * 2 * 10 * 4 * 4 + 4 * 4  # the kv of 10 tokens + a hidden state of 4 floats
    cache = UserStateCache(budget_bytes=2 * one)
    cache.store(list(range(10)), _kv(10), torch.zeros(4), None)
    assert cache.lookup(list(range(10)))[1] == 10  # full
    assert cache.lookup(list(range(12)))[1] == 10  # partial: extends the cached prompt
    assert cache.lookup([9] * 12) == (None, 0)  # miss
    cache.store(list(range(1, 11)), _kv(10), torch.zeros(4), None)
    cache.lookup(list(range(10)))  # the first entry is now the most recent
    cache.store(list(range(2, 12)), _kv(10), torch.zeros(4), None)  # over budget: the LRU entry goes
    assert cache.lookup(list(range(1, 11))) == (None, 0)
    assert cache.stats() == {"hits": 2, "partial_hits": 1, "misses": 2, "evictions": 1, "bytes": 2 * one,
                             "entries": 2, "row_hits": 0, "row_misses": 0, "row_bytes": 0, "rows": 0}
    other = UserStateCache(budget_bytes=2 * one, version="v2")
    assert other.lookup(list(range(10))) == (None, 0)


def test_decode_steps_count_in_the_budget() -> None:
    cache = UserStateCache(budget_bytes=1 << 20)
    entry = cache.store([1, 2, 3], _kv(3), torch.zeros(4), None)
    assert entry is not None
    before = cache.bytes
    cache.add_step(entry, (5, 6), torch.zeros(1, 2, 2, 2, 4), torch.zeros(2, 4))
    assert cache.bytes == before + 2 * 2 * 2 * 4 * 4 + 2 * 4 * 4 and (5, 6) in entry.steps
    tiny = UserStateCache(budget_bytes=cache.bytes - 1)  # the same entry and step no longer fit: evicted
    e2 = tiny.store([1, 2, 3], _kv(3), torch.zeros(4), None)
    assert e2 is not None
    tiny.add_step(e2, (5, 6), torch.zeros(1, 2, 2, 2, 4), torch.zeros(2, 4))
    assert len(tiny) == 0 and tiny.bytes == 0 and tiny.stats()["evictions"] == 1


@pytest.fixture(scope="module")
def setup():
    trie = CatalogTrie(random_catalog(300, L, C, 1))
    model = EngineModel.build(tiny_llama(L, C, 1), "fp32")
    drafter = LlamaDrafter(EngineModel.build(tiny_llama(L, C, 2, hidden=16, layers=1), "fp32"), trie, TEXT_VOCAB)
    assert model.plan.fast
    return trie, model, drafter, BeamSearch(model, trie, TEXT_VOCAB)


def test_plain_with_the_cache_returns_what_it_returns_without(setup) -> None:
    _, model, _, engine = setup
    cache = UserStateCache(1 << 30)
    for prompt in random_prompts(5, 2, 3, 20):
        ref = engine.search(batch([prompt]), 5)
        first = engine.search(batch([prompt]), 5, states=cache)  # a miss: computes and stores
        again = engine.search(batch([prompt]), 5, states=cache)  # an identical request: no forward at all
        wider = engine.search(batch([prompt]), 6, states=cache)  # other beams: only the prompt is reused
        assert torch.equal(first.leaves, ref.leaves) and torch.equal(first.scores, ref.scores)
        assert torch.equal(again.leaves, ref.leaves) and torch.equal(again.scores, ref.scores)
        ref6 = engine.search(batch([prompt]), 6)
        assert torch.equal(wider.leaves, ref6.leaves) and torch.equal(wider.scores, ref6.scores)
        assert first.target_calls == L and again.target_calls == 0 and wider.target_calls == L - 1
        longer = prompt + [5, 6, 7, 8, 9]  # a new interaction: only its tokens run
        ext, ref_ext = engine.search(batch([longer]), 5, states=cache), engine.search(batch([longer]), 5)
        assert torch.equal(ext.leaves, ref_ext.leaves)
        torch.testing.assert_close(ext.scores, ref_ext.scores, atol=PARTIAL_TOL, rtol=0)
    assert cache.stats()["hits"] == 10 and cache.stats()["partial_hits"] == 5


def test_batches_mixing_hits_and_misses(setup) -> None:
    _, _, _, engine = setup
    cache = UserStateCache(1 << 30)
    prompts = random_prompts(4, 3, 3, 20)
    engine.search(batch(prompts[:2]), 4, states=cache)
    mixed = engine.search(batch(prompts), 4, states=cache)
    ref = engine.search(batch(prompts), 4)
    assert torch.equal(mixed.leaves, ref.leaves)
    torch.testing.assert_close(mixed.scores, ref.scores, atol=PARTIAL_TOL, rtol=0)


def test_strict_and_sampling_use_it(setup) -> None:
    trie, model, drafter, engine = setup
    cache = UserStateCache(1 << 30)
    for prompt in random_prompts(4, 4, 3, 20):
        plain = engine.search(batch([prompt]), 5)
        for _ in range(2):  # a miss, then a full hit
            spec = speculative_search(model, trie, TEXT_VOCAB, batch([prompt]), 5,
                                      drafter.session(batch([prompt]), [], None), 5, 3, None, engine.select,
                                      states=cache)
            assert torch.equal(spec.leaves, plain.leaves)
            torch.testing.assert_close(spec.scores, plain.scores, atol=PARTIAL_TOL, rtol=0)
        runs = [sampling_beam_search(model, trie, TEXT_VOCAB, batch([prompt]), 3, torch.ones(1), make_generators([7]),
                                     states=states) for states in (None, cache, cache)]
        assert all(torch.equal(r.leaves, runs[0].leaves) for r in runs)
    assert cache.stats()["hits"] >= 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from recsvc.recommender.bundle_recommender import BundleRecommender, state_cache_for

    rec = BundleRecommender.from_bundle(make_tiny_bundle(tmp_path_factory.mktemp("bundle"), n_users=40),
                                        dtype="fp32")
    rec = rec.variant(states=state_cache_for(rec.target, 64 << 20, "test"))
    assert rec.states is not None
    return rec


def test_grpc_second_identical_request_is_a_hit_with_identical_items(make_server, served) -> None:
    server = make_server(served, metrics_port=0)
    items = served.popular_items(6)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        client.record("u1", items[:3])
        first = client.recommend("u1", k=5, mode="plain")
        hits = served.states.stats()["hits"]
        second = client.recommend("u1", k=5, mode="plain")
    assert served.states.stats()["hits"] == hits + 1
    assert [(i.item_id, i.score) for i in second.items] == [(i.item_id, i.score) for i in first.items]
    assert first.stats.target_forward_calls == 4 and second.stats.target_forward_calls == 0  # replayed steps
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    assert f"recsvc_state_cache_hits_total {float(hits + 1)}" in text
    assert "recsvc_state_cache_bytes" in text


def test_prefill_ahead_after_a_write_makes_the_next_request_a_hit(make_server, served) -> None:
    import time

    from recsvc.recommender.api import RecQuery

    served = served.variant(prefill_ahead=True, beam_width=5)  # a served width: the whole request computed ahead
    server = make_server(served)
    items = served.popular_items(8)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        client.record("u-ahead", items[4:7])
        deadline = time.monotonic() + 10
        before = served.states.stats()
        while served.states.stats()["entries"] == before["entries"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the prefill runs on the batcher's idle thread once the engine is free
        got = client.recommend("u-ahead", k=5, mode="plain")
    after = served.states.stats()
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"]  # ahead: not counted
    assert got.stats.target_forward_calls == 0  # the prompt and every decode step were computed ahead
    ref = served.variant(states=None).recommend([RecQuery(history=items[4:7], k=5, mode="plain")])[0]
    assert [i.item_id for i in got.items] == ref.item_ids
    assert [i.score for i in got.items] == pytest.approx(ref.scores, abs=1e-6)
    # a request of another k (up to the served width) is the same beams: also no forward
    assert served.recommend([RecQuery(history=items[4:7], k=2, mode="plain")])[0].stats.target_calls == 0


def test_recommender_runs_cached_prompts_apart_from_the_batch(served) -> None:
    """A batch of plain requests where some users' prompts are cached: those run one by one (an identical repeat
    costs no forward), the others share one batch; the items and scores are those of a cache-free decode."""
    from recsvc.recommender.api import RecQuery

    rec = served
    rec.states.clear()
    histories = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]
    queries = [RecQuery(history=h, k=5, mode="plain") for h in histories]
    ref = [rec.recommend([q])[0] for q in queries]  # each alone: the first two are now cached (and so all four)
    rec.states.clear()
    rec.recommend(queries[:2])  # users 0 and 1 cached
    assert rec._split_cached("plain", False, [0, 1, 2, 3], queries) == [[0], [1], [2, 3]]
    mixed = rec.recommend(queries)
    for got, want in zip(mixed, ref, strict=True):
        assert got.item_ids == want.item_ids
        assert got.scores == pytest.approx(want.scores, abs=PARTIAL_TOL)
    assert [m.stats.target_calls for m in mixed[:2]] == [0, 0]  # identical repeats: every step cached
    assert rec._split_cached("strict", False, [0, 1, 2, 3], queries) == [[0, 1, 2, 3]]  # only plain splits
