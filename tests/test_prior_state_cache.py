"""A returning user's fused prior row kept with the user-state cache (``UserStateCache.prior``): with a cache on,
a single history's ``prior_for`` is computed once and served again bit for bit; batches are computed together
and never kept; another prior (or weight) misses; the row store is bounded and emptied with the cache."""

from __future__ import annotations

import pytest
import torch
from test_service_prior import WEIGHT, bundle, histories, only_our_commands  # noqa: F401 (fixtures)
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.engine.caches import state_cache
from recsvc.engine.caches.state_cache import UserStateCache
from recsvc.priors.transition import PriorSettings
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender, state_cache_for

pytestmark = pytest.mark.usefixtures("one_thread")


def test_single_history_prior_is_kept_and_served_bit_for_bit(bundle) -> None:  # noqa: F811
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", use_drafter=False)
    assert rec.prior is not None and rec.prior_weight == WEIGHT
    hist = histories(bundle, 4)
    fresh = [rec.prior_for([h]) for h in hist]  # no state cache: computed every time
    rec = rec.variant(states=state_cache_for(rec.target, 64 << 20, "test"))
    assert rec.states is not None
    first = [rec.prior_for([h]) for h in hist]
    again = [rec.prior_for([h]) for h in hist]
    for f, a, b in zip(fresh, first, again, strict=True):
        assert f.shape == a.shape == (1, rec.trie.num_nodes) and torch.equal(f, a) and torch.equal(a, b)
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # the kept row, not recomputed
    # a batch is computed together and not kept (its rows may round apart from single ones)
    kept = rec.states._prior_bytes
    both = rec.prior_for(hist[:2])
    assert both.shape == (2, rec.trie.num_nodes) and rec.states._prior_bytes == kept
    # another prior object (new weight) misses; requests with the cache on return what they return without
    halved = rec.variant(prior=rec.prior.with_settings(PriorSettings(window=1, decay=0.5, beta=1.0,
                                                                     weight=WEIGHT / 2)))
    other = halved.prior_for([hist[0]])  # the same cache, another prior object
    assert not torch.equal(other, first[0])
    assert torch.allclose(other, first[0] / 2, atol=1e-5)
    cached = [rec.recommend([RecQuery(h, k=5, mode="plain")])[0] for h in hist]
    rec.states.clear()
    assert rec.states._prior_bytes == 0 and rec.states.prior(("anything",)) is None
    plain = [rec.variant(states=None).recommend([RecQuery(h, k=5, mode="plain")])[0] for h in hist]
    for c, p in zip(cached, plain, strict=True):
        assert c.item_ids == p.item_ids and c.scores == p.scores


def test_prior_rows_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(state_cache, "MAX_PRIORS", 3)
    cache = UserStateCache(4 * 4 * 100, "v")  # budget / 4 = 400 bytes = 100 float32 values
    for i in range(5):
        cache.keep_prior(("u", i), torch.zeros(10))
    assert [cache.prior(("u", i)) is not None for i in range(5)] == [False, False, True, True, True]
    cache.keep_prior(("big",), torch.zeros(90))  # 360 bytes: the older rows go first
    assert cache.prior(("big",)) is not None and cache._prior_bytes <= 400
    assert sum(cache.prior(("u", i)) is not None for i in range(5)) <= 1


def test_prior_rows_give_way_to_user_states() -> None:
    """Over the budget, prior rows are dropped before any user's prompt state (a state saves forwards, a prior
    row about a millisecond)."""
    kv = [(torch.zeros(2, 10, 4), torch.zeros(2, 10, 4))]
    one = 2 * 2 * 10 * 4 * 4 + 4 * 4  # one state: the kv of 10 tokens + a hidden state of 4 floats
    cache = UserStateCache(3 * one, "v")
    cache.keep_prior(("p", 0), torch.zeros(one // 8))  # half a state's bytes (within budget / 4)
    cache.store(list(range(10)), kv, torch.zeros(4), None)
    cache.store(list(range(1, 11)), kv, torch.zeros(4), None)
    assert cache.prior(("p", 0)) is not None  # room for both
    cache.store(list(range(2, 12)), kv, torch.zeros(4), None)  # three states fill the budget: the row goes
    assert cache.prior(("p", 0)) is None and len(cache) == 3 and cache.stats()["evictions"] == 0
    cache.keep_prior(("p", 1), torch.zeros(4))  # no room left: the new row is not kept, no state is evicted
    assert cache.prior(("p", 1)) is None and len(cache) == 3
