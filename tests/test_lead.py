"""The paired lead of a model over a baseline (training/evaluation/lead.py): ratio of means with a bootstrap
interval."""

from __future__ import annotations

import numpy as np

from recsvc.data.split import EvalUser
from training.evaluation.lead import best_baseline, format_leads, leads, paired_lead, per_user


def test_identical_lists_lead_by_exactly_one() -> None:
    x = np.random.default_rng(1).random(300)
    r = paired_lead(x, x.copy(), resamples=300)
    assert r["ratio"] == 1.0 and r["ratio_lo"] == 1.0 and r["ratio_hi"] == 1.0
    assert r["diff"] == 0.0 and r["diff_se"] == 0.0


def test_a_lead_on_every_user_has_an_interval_above_one_and_noise_widens_it() -> None:
    rng = np.random.default_rng(0)
    base = rng.random(2000)
    clear = paired_lead(base * 1.2, base, resamples=500)
    assert abs(clear["ratio"] - 1.2) < 1e-9 and clear["ratio_lo"] > 1.0
    noisy = paired_lead(rng.permutation(base * 1.2), base, resamples=500)  # same means, pairing broken
    assert noisy["ratio_hi"] - noisy["ratio_lo"] > clear["ratio_hi"] - clear["ratio_lo"]
    assert noisy["ratio_lo"] <= noisy["ratio"] <= noisy["ratio_hi"]


def test_the_interval_is_reproducible_and_undefined_ratios_are_none() -> None:
    rng = np.random.default_rng(2)
    m, b = (rng.random(100) > 0.8).astype(float), (rng.random(100) > 0.9).astype(float)
    assert paired_lead(m, b, seed=3) == paired_lead(m, b, seed=3)
    zero = paired_lead(m, np.zeros(100))
    assert zero["ratio"] is None and zero["ratio_lo"] is None


def test_leads_score_each_cutoff_of_each_baseline_and_name_the_best() -> None:
    users = [EvalUser(1, [9], [5]), EvalUser(2, [9], [6]), EvalUser(3, [9], [7]), EvalUser(4, [9], [])]
    model = {1: [5, 1], 2: [1, 6], 3: [1, 2]}
    base = {1: [5, 1], 2: [1, 2], 3: [1, 2]}
    assert per_user(model, users, 2, "recall").tolist() == [1.0, 1.0, 0.0]  # the user without targets skipped
    out = leads(lambda k: model, {"b": lambda k: base}, users, (1, 2), resamples=100)
    assert set(out["b"]) == {"recall@1", "ndcg@1", "recall@2", "ndcg@2"}
    assert out["b"]["recall@2"]["ratio"] == 2.0 and out["b"]["recall@1"]["ratio"] == 1.0
    result = {"baselines": {"b": {"recall@2": 1 / 3}, "a": {"recall@2": 0.1}, "b+fresh": {"recall@2": 0.9}},
              "lead": out}
    assert best_baseline(result, "recall@2") == "b"  # a "+fresh" variant is not a baseline of its own
    assert "Recall@2 2.000x" in format_leads(result, (2,))
