"""Fresh items (recsvc/content/fresh.py): content candidates, the tail merge, storage; the cold / warm slices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recsvc.content.fresh import FreshItems, FreshSettings, ItemVectors, fresh_items_of
from recsvc.data.metrics import evaluate_slices, score_lists
from recsvc.data.split import EvalUser
from recsvc.errors import UserError

# items 1-3 warm, 10-12 fresh; 2-d vectors: 1 and 10 point east, 2 and 11 north, 3 and 12 west
VECS = ItemVectors.from_arrays([1, 2, 3, 10, 11, 12],
                               np.array([[1, 0], [0, 1], [-1, 0], [2, 0.1], [0.1, 2], [-1, -0.2]]))


def fresh(slots: int = 2, window: int = 1, min_similarity: float = -1.0) -> FreshItems:
    return FreshItems(VECS, [10, 11, 12], FreshSettings(slots, window, min_similarity))


def test_candidates_rank_fresh_items_by_similarity_to_the_last_history_items() -> None:
    f = fresh(window=1)
    (c,) = f.candidates([[2, 1]], 3)  # last item 1 (east): 10 first, 11 (north) next, 12 (west) last
    assert [i for i, _ in c] == [10, 11, 12]
    assert c[0][1] == pytest.approx(2 / np.hypot(2, 0.1)) and c[0][1] > c[1][1] > c[2][1]
    (c,) = fresh(window=2).candidates([[2, 1]], 1)  # mean of east and north: 10 and 11 near tie, 10 wins
    assert c[0][0] in (10, 11)
    # history and excluded items are skipped; an unknown history gives nothing
    assert [i for i, _ in f.candidates([[1, 10]], 3)[0]] == [11, 12]  # 10 is in the history
    assert [i for i, _ in f.candidates([[1]], 3, [[10]])[0]] == [11, 12]
    assert f.candidates([[999]], 2) == [[]]


@pytest.mark.parametrize(("settings", "ranked", "cands", "k", "expected"), [
    # two slots: the tail of the model's list goes to the two candidates
    (FreshSettings(2, 1, -1.0), [7, 3, 9, 5], [(40, 0.8), (41, 0.45)], 4, [7, 3, 40, 41]),
    # a candidate below min_similarity keeps the model's item
    (FreshSettings(2, 1, 0.5), [7, 3, 9, 5], [(40, 0.8), (41, 0.45)], 4, [7, 3, 9, 40]),
    # slots 0: the model's list unchanged
    (FreshSettings(0, 1, -1.0), [7, 3, 9, 5], [(40, 0.8)], 4, [7, 3, 9, 5]),
    # k = 1: the model keeps its head (at most k - 1 slots)
    (FreshSettings(3, 1, -1.0), [7, 3], [(40, 0.8)], 1, [7]),
    # a candidate already in the model's list is not repeated
    (FreshSettings(2, 1, -1.0), [7, 40, 9, 5], [(40, 0.9), (41, 0.8)], 4, [7, 9, 40, 41]),
])
def test_merge(settings, ranked, cands, k, expected) -> None:
    assert fresh().with_settings(settings).merge(ranked, cands, k) == expected


def test_apply_save_load_and_errors(tmp_path: Path) -> None:
    f = fresh(slots=1)
    assert f.apply([[1, 2, 3]], [[3]], 3) == [[1, 2, 12]]  # last item 3 (west): fresh 12
    f.save(tmp_path / "fresh")
    g = FreshItems.load(tmp_path / "fresh")
    assert g.settings == f.settings and g.fresh_ids.tolist() == [10, 11, 12]
    assert np.allclose(g.vectors.vectors, f.vectors.vectors, atol=1e-3)  # stored as float16
    assert g.apply([[1, 2, 3]], [[3]], 3) == [[1, 2, 12]]
    with pytest.raises(UserError, match="without an embedding"):
        FreshItems(VECS, [99], FreshSettings())
    with pytest.raises(UserError, match="out of range"):
        FreshSettings(slots=-1)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "fresh.json").write_text("{}")
    with pytest.raises(UserError, match="not a fresh-items record"):
        FreshItems.load(tmp_path / "bad")
    assert fresh_items_of([1, 2, 10], [1, 2, 2]) == [10]
    added = VECS.with_items([20], np.array([[0.0, -1.0]]))
    assert added.rows([20, 1, 99]).tolist() == [6, 0, -1]


def test_slices_split_targets_not_lists() -> None:
    users = [EvalUser(1, [1], [2, 10]), EvalUser(2, [1], [3]), EvalUser(3, [2], [11])]
    rankings = {1: [10, 5], 2: [4, 3], 3: [5, 6]}
    s = evaluate_slices(rankings, users, (2,), {10, 11})
    # cold: user 1 (target 10, hit) and user 3 (11, miss); warm: user 1 (2, miss) and user 2 (3, hit)
    assert s["cold"]["recall@2"] == pytest.approx(0.5) and s["cold"]["users"] == 2
    assert s["warm"]["recall@2"] == pytest.approx(0.5) and s["warm"]["users"] == 2
    # score_lists reads a list per cutoff and carries the slices
    out = score_lists(lambda k: {u: r[:k] for u, r in rankings.items()}, users, (1, 2), {10, 11})
    assert out["recall@1"] == pytest.approx((0.5 + 0 + 0) / 3) and out["cold"]["recall@1"] == pytest.approx(0.5)


def test_served_lists_end_with_the_fresh_slots(tmp_path: Path) -> None:
    """BundleRecommender with BUNDLE/fresh: the model's list with its tail given to the most similar fresh item;
    use_fresh=False (serve --no-fresh) decodes exactly as before; requests with rules are left as decoded."""
    from test_drafter_fixtures import tiny_bundle

    from recsvc.bundle.directory import Bundle
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender
    from recsvc.rules.spec import Rules

    root = tiny_bundle(tmp_path)
    bundle = Bundle.open(root)
    items = bundle.load_ids().item_ids.tolist()
    rng = np.random.default_rng(0)
    vecs = ItemVectors.from_arrays(items, rng.normal(size=(len(items), 8)))
    history = items[:3]
    # the fresh item is the one closest to the history's last item: item 60 copies item 3's vector
    vecs = vecs.with_items([items[-1]], vecs.vectors[vecs.rows([history[-1]])])
    FreshItems(vecs, [items[-1], items[-2]], FreshSettings(slots=1, window=1, min_similarity=0.9)).save(
        bundle.fresh_dir)
    off = BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False, use_fresh=False)
    on = BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False)
    q = RecQuery(history=history, k=5)
    (a,), (b,) = off.recommend([q]), on.recommend([q])
    assert a.fresh == 0 and b.fresh == 1
    assert b.item_ids == [i for i in a.item_ids if i != items[-1]][:4] + [items[-1]]
    assert b.scores[:4] == a.scores[:4] and b.scores[4] == pytest.approx(1.0, abs=1e-3)  # cosine similarity
    # a history whose last item resembles no fresh item (min_similarity 0.9): no slot, the model's list
    far = next(i for i in items[3:-2] if float(vecs.vectors[vecs.rows([i])][0] @ vecs.vectors[-1]) < 0.5
               and float(vecs.vectors[vecs.rows([i])][0] @ vecs.vectors[-2]) < 0.5)
    (c,), (c_off,) = on.recommend([RecQuery(history=[far], k=5)]), off.recommend([RecQuery(history=[far], k=5)])
    assert c.fresh == 0 and c.item_ids == c_off.item_ids
    (d,) = on.recommend([RecQuery(history=history, k=5, rules=Rules())])
    assert d.fresh == 0


def test_fresh_candidates_follow_the_catalog_of_the_period(tmp_path: Path) -> None:
    """Valid: items first seen in valid (an item first seen in test is not in the catalog yet); test: every
    item without a train / valid interaction."""
    from recsvc.data.split import load_split_dir
    from training.evaluation.fresh import cold_items, fresh_candidates

    (tmp_path / "sequential_train.txt").write_text("1 1 2\n2 2 3\n")
    (tmp_path / "sequential_valid.txt").write_text("1 4\n2 3\n")
    (tmp_path / "sequential_test.txt").write_text("1 5\n2 4\n")
    (tmp_path / "items.json").write_text('{"1": {}, "2": {}, "3": {}, "4": {}, "5": {}}')
    data = load_split_dir(tmp_path)
    catalog = [1, 2, 3, 4, 5]
    assert fresh_candidates(data, "valid", "train", catalog) == {4}
    assert cold_items(data, "train", catalog) == {4, 5}  # the slice: targets without a train interaction
    assert fresh_candidates(data, "test", "train+valid", catalog) == {5}
    assert fresh_candidates(data, "test", "train", catalog) == {4, 5}  # paper protocol: fitted on train


def test_rate_threshold_lets_that_share_of_histories_pass() -> None:
    f = fresh(window=2)
    # best candidate per history: east 1 -> 10 (0.999), west 3 -> 12 (0.98), north-east [1, 2] -> 10 (0.74),
    # unknown -> none
    histories = [[1], [3], [1, 2], [999]]
    best = [c[0][1] if c else -1.0 for c in f.candidates(histories, 1)]
    for rate in (0.25, 0.5, 0.75):
        t = f.rate_threshold(histories, rate)
        assert sum(b >= t for b in best) == round(rate * len(histories))  # exactly that share passes
    assert f.rate_threshold(histories, 1.0) == -1.0  # every history, even one without a candidate
    # another fresh set reading less like the histories gets a lower threshold for the same rate
    west = FreshItems(VECS, [12], FreshSettings(2, 2))
    assert west.rate_threshold(histories, 0.5) < f.rate_threshold(histories, 0.5)
    resolved = f.resolve_rate(histories, 0.5)
    assert resolved.settings.rate == 0.5 and resolved.settings.min_similarity == f.rate_threshold(histories, 0.5)
    assert resolved.settings.slots == f.settings.slots and resolved.fresh_ids.tolist() == [10, 11, 12]
    for bad in (0.0, 1.5):
        with pytest.raises(UserError):
            FreshSettings(2, 1, rate=bad)
        with pytest.raises(UserError):
            f.rate_threshold(histories, bad)


def test_rate_survives_save_and_load(tmp_path: Path) -> None:
    f = fresh(window=1).resolve_rate([[1], [2], [3]], 0.5)
    f.save(tmp_path / "fresh")
    back = FreshItems.load(tmp_path / "fresh")
    assert back.settings == f.settings and back.settings.rate == 0.5


def test_prefix_sharing_counts_new_items_on_trained_code_paths() -> None:
    from tokenizer_rqvae.ids import SemanticIds
    from training.evaluation.fresh import prefix_sharing

    ids = SemanticIds.from_mapping({1: (1, 2, 3, 4), 2: (1, 2, 9, 9), 3: (1, 5, 0, 0), 4: (7, 0, 0, 0)}, 16)
    assert prefix_sharing(ids, [2, 3, 4], [1]) == {"1": 2 / 3, "2": 1 / 3, "3": 0.0}
    assert prefix_sharing(ids, [], [1]) == {"1": 0.0, "2": 0.0, "3": 0.0}
