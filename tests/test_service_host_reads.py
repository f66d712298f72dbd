"""The service's sampled host-read count (``recsvc serve --count-host-reads N``): RecStats.host_reads and the
``recsvc_host_reads`` metric, on a tiny real bundle served over gRPC."""

from __future__ import annotations

import pytest
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle

from recsvc.client.client import RecClient
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("bundle"), n_users=80)


def test_sampled_calls_report_their_host_reads_and_the_bucketed_forward_reads_less(tiny_bundle) -> None:
    rec = BundleRecommender.from_bundle(tiny_bundle, dtype="fp32").variant(count_host_reads=2)  # every second call
    history = rec.popular_items(6)[:4]
    query = [RecQuery(history=history, k=5, mode="strict")]
    first, second = rec.recommend(query), rec.recommend(query)
    assert first[0].stats.host_reads == -1 and second[0].stats.host_reads > 0
    fast_reads = second[0].stats.host_reads
    rec = BundleRecommender.from_bundle(tiny_bundle, dtype="fp32", forward="bucketed").variant(count_host_reads=1)
    rec.recommend(query)  # the first call on a fresh model builds its static caches (reads while it does)
    out = rec.recommend(query)
    assert out[0].item_ids == first[0].item_ids  # the same list on the bucketed path
    # the engine's rounds read once each; the rest are the call's own, once per request (the lists read out)
    assert 0 < out[0].stats.host_reads < fast_reads


def test_the_metric_counts_sampled_reads(make_server, tiny_bundle) -> None:
    rec = BundleRecommender.from_bundle(tiny_bundle, dtype="fp32").variant(count_host_reads=1)
    server = make_server(rec)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        client.recommend("u1", history=rec.popular_items(4), k=5, mode="plain")
    value = server.metrics.registry.get_sample_value("recsvc_host_reads_total")
    assert value is not None and value > 0
