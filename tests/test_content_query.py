"""The learned content query: numpy inference, storage, and a fit that learns what the mean query cannot."""

from __future__ import annotations

import numpy as np
import pytest

from recsvc.content.fresh import FreshItems, FreshSettings, ItemVectors, query_file
from recsvc.content.query import ContentQuery
from recsvc.errors import UserError
from training.tuning.content_query import QueryFit, fit_content_query, fit_or_reuse, training_pairs


def _identity(length: int, d: int) -> ContentQuery:
    return ContentQuery(np.zeros(length, np.float32), np.eye(d, dtype=np.float32), np.eye(d, dtype=np.float32))


def test_worked_example():
    q = _identity(2, 2)
    query = q.query(np.array([[1.0, 0.0], [0.0, 1.0]]))
    np.testing.assert_allclose(query, [0.7071068, 0.7071068], atol=1e-6)
    scores = q.items(np.array([[1.0, 0.0], [0.6, 0.8]])) @ query
    np.testing.assert_allclose(scores, [0.7071068, 0.9899495], atol=1e-6)


def test_reads_only_the_last_length_items_with_their_position_weights():
    q = ContentQuery(np.array([0.0, 50.0], np.float32), np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32))
    # the latest item's weight dominates; the first of three items is beyond the length
    np.testing.assert_allclose(q.query(np.array([[5.0, 5.0], [1.0, 0.0], [0.0, 1.0]])), [0.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(q.query(np.array([[1.0, 0.0]])), [1.0, 0.0], atol=1e-6)  # one item: weight 1


def test_bad_shapes_are_refused():
    with pytest.raises(UserError, match="bad shapes"):
        ContentQuery(np.zeros(3, np.float32), np.eye(2, dtype=np.float32), np.eye(3, dtype=np.float32))


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    q = ContentQuery(rng.normal(size=4).astype(np.float32), rng.normal(size=(3, 3)).astype(np.float32),
                     rng.normal(size=(3, 3)).astype(np.float32), {"period": "train", "pairs": 7})
    q.save(tmp_path / "q.safetensors")
    back = ContentQuery.load(tmp_path / "q.safetensors")
    np.testing.assert_array_equal(back.query_weight, q.query_weight)
    np.testing.assert_array_equal(back.position_logits, q.position_logits)
    assert back.fit == {"period": "train", "pairs": 7}
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="not a content-query file"):
        ContentQuery.load(tmp_path / "bad.safetensors")


def test_training_pairs_left_pad_and_skip_unknown_items():
    hist, mask, target = training_pairs([[10, 11, 99, 12]], {10: 0, 11: 1, 12: 2}, length=2)
    assert hist.tolist() == [[0, 0], [0, 1]] and mask.tolist() == [[0.0, 1.0], [1.0, 1.0]]
    assert target.tolist() == [1, 2]


def _cycle_catalog(seed: int = 0):
    """Four clusters of item texts; after an item of cluster k comes one of cluster k+1 (mod 4). Items 100..103
    (one per cluster) never occur in a sequence: the fresh items."""
    rng = np.random.default_rng(seed)
    d, per = 8, 6
    centers = np.eye(d)[:4] * 3.0
    ids, vecs, cluster = [], [], {}
    for k in range(4):
        for j in range(per):
            item = 10 * k + j + 1
            ids.append(item)
            vecs.append(centers[k] + rng.normal(scale=0.3, size=d))
            cluster[item] = k
        ids.append(100 + k)
        vecs.append(centers[k] + rng.normal(scale=0.3, size=d))
        cluster[100 + k] = k
    sequences = {}
    for u in range(120):
        k = int(rng.integers(4))
        seq = []
        for _ in range(6):
            seq.append(10 * k + int(rng.integers(per)) + 1)
            k = (k + 1) % 4
        sequences[u] = seq
    return ItemVectors.from_arrays(ids, np.asarray(vecs)), sequences, cluster


def test_fit_learns_the_next_cluster_where_the_mean_query_cannot():
    vectors, sequences, cluster = _cycle_catalog()
    query = fit_content_query(sequences, vectors, QueryFit(length=3, epochs=8, lr=0.05, batch=32), "train",
                              progress=False)
    assert query.fit["period"] == "train" and query.fit["pairs"] == 120 * 5
    fresh = [100, 101, 102, 103]
    learned = FreshItems(vectors, fresh, FreshSettings(slots=1, window=3, query="learned"), "train", query)
    mean = FreshItems(vectors, fresh, FreshSettings(slots=1, window=1), "train")
    histories = [[10 * k + 1, 10 * ((k + 1) % 4) + 2] for k in range(4)] * 3
    right_learned = right_mean = 0
    for hist, got_l, got_m in zip(histories, learned.candidates(histories, 1), mean.candidates(histories, 1),
                                  strict=True):
        want = (cluster[hist[-1]] + 1) % 4
        right_learned += cluster[got_l[0][0]] == want
        right_mean += cluster[got_m[0][0]] == want
    assert right_learned == len(histories)  # the fresh item of the next cluster, for every history
    assert right_mean == 0  # the mean query finds the fresh item that reads like the last item


def test_fit_or_reuse_skips_a_stored_fit_with_the_same_record(tmp_path):
    vectors, sequences, _ = _cycle_catalog()
    path = tmp_path / "query-train.safetensors"
    settings = QueryFit(length=3, epochs=1, batch=64)
    first = fit_or_reuse(path, sequences, vectors, settings, "train", progress=False)
    stamp = path.stat().st_mtime_ns
    again = fit_or_reuse(path, sequences, vectors, settings, "train", progress=False)
    assert path.stat().st_mtime_ns == stamp and again.fit == first.fit
    other = fit_or_reuse(path, sequences, vectors, QueryFit(length=3, epochs=1, batch=64, seed=1), "train",
                         progress=False)
    assert other.fit["seed"] == 1 and path.stat().st_mtime_ns != stamp


def test_fresh_items_store_and_pick_the_query_of_a_period(tmp_path):
    vectors, sequences, _ = _cycle_catalog()
    with pytest.raises(UserError, match="learned query"):
        FreshItems(vectors, [100], FreshSettings(slots=1, query="learned"), "train+valid")
    q_served = fit_content_query(sequences, vectors, QueryFit(length=3, epochs=1), "train+valid", progress=False)
    q_train = fit_content_query(sequences, vectors, QueryFit(length=3, epochs=1, seed=3), "train",
                                progress=False)
    FreshItems(vectors, [100, 101], FreshSettings(slots=2, query="learned"), "train+valid", q_served).save(tmp_path)
    q_train.save(query_file(tmp_path, "train"))
    served = FreshItems.load(tmp_path)
    assert served.settings.query == "learned" and served.query is not None
    np.testing.assert_array_equal(served.query.item_weight, q_served.item_weight)
    on_valid = FreshItems.load(tmp_path, period="train")
    assert on_valid.query is not None and on_valid.query.fit["seed"] == 3
    with pytest.raises(UserError, match="learned query"):
        FreshItems.load(tmp_path, period="nothing-fitted")


def test_settings_refuse_an_unknown_query():
    with pytest.raises(UserError, match="out of range"):
        FreshSettings(query="fancy")
