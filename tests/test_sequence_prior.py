"""The mixed prior (recsvc/model/sequence_prior.py): transition counts + a SASRec's softmax, stored and tuned."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_drafter_fixtures import tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from recsvc.errors import UserError
from recsvc.model.bundle import Bundle
from recsvc.model.sasrec import SASRec
from recsvc.model.sequence_prior import MixedPrior, MixSettings, SequenceModel, load_prior
from recsvc.model.transition import PriorSettings, TransitionPrior

pytestmark = pytest.mark.usefixtures("one_thread")


def _priors(mix: float, temperature: float = 1.0) -> tuple[TransitionPrior, SequenceModel, MixedPrior]:
    catalog = [1, 2, 3, 4]
    trans = TransitionPrior.fit([[1, 2], [1, 2], [2, 3]], catalog, PriorSettings(beta=0.0, weight=1.0))
    torch.manual_seed(0)
    seq = SequenceModel(SASRec(3, hidden=8, blocks=1, max_len=5), np.array([1, 2, 3]), 5)  # item 4: fresh
    return trans, seq, MixedPrior(trans, seq, MixSettings(mix, temperature))


def test_mixed_probs_are_the_weighted_sum_over_catalog_columns() -> None:
    trans, seq, mixed = _priors(0.3, 2.0)
    hist = [[1], [2, 3]]
    p = trans.probs(hist)  # [2, 4]
    logq, known = seq.log_probs(hist, 2.0)  # [2, 3] over items 1, 2, 3
    q = np.concatenate([logq.exp().numpy(), np.zeros((2, 1), np.float32)], axis=1)
    expected = 0.7 * p + 0.3 * q
    got = mixed.probs(hist)
    assert known.all() and np.allclose(got, expected, atol=1e-6) and np.allclose(got.sum(1), 1.0, atol=1e-5)
    assert got[0, 3] == pytest.approx(0.7 * p[0, 3])  # the fresh item keeps only the transition part
    # mix 0 is the transition prior itself; a history of unknown items keeps the transition prior only
    assert np.array_equal(_priors(0.0)[2].probs(hist), p)
    assert np.allclose(mixed.probs([[99]]), trans.probs([[99]]))
    assert mixed.settings == trans.settings and mixed.item_ids.tolist() == [1, 2, 3, 4]
    with pytest.raises(UserError, match="out of range"):
        MixSettings(mix=1.5)


def test_tune_mix_writes_a_mixed_prior_that_serving_and_eval_load(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"tune": "training.tune", "eval": "training.eval_cli"})
    root = tiny_bundle(tmp_path, n_users=60)
    base = ["--bundle", str(root), "--users", "20", "--dtype", "fp32", "--budget-minutes", "5"]
    assert cli.main(["tune", "mix", *base, "--trials", "2"]) == 2  # no transition prior yet: a clear error
    assert cli.main(["tune", "prior", *base, "--trials", "2"]) == 0
    assert cli.main(["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2"]) == 0
    b = Bundle.open(root)
    record = b.read()["tuning"]["mix"]
    assert record["trials"] == 3 and record["valid"]["ndcg@10"] >= record["valid_transition_only"]["ndcg@10"]
    prior = load_prior(b.prior_dir)
    assert isinstance(prior, MixedPrior) and prior.mix.mix == pytest.approx(record["settings"]["mix"])
    assert prior.settings.weight == pytest.approx(record["settings"]["weight"])
    assert (b.prior_dir / "sequence-train" / "model.safetensors").is_file()
    from recsvc.recommender.bundle_recommender import BundleRecommender

    rec = BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False)
    assert isinstance(rec.prior, MixedPrior)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "10", "--dtype", "fp32",
                     "--baselines", "none", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prior"]["mix"] == pytest.approx(prior.mix.mix)
    # re-tuning the transition prior drops the stale mix
    assert cli.main(["tune", "prior", *base, "--trials", "3"]) == 0
    assert isinstance(load_prior(b.prior_dir), TransitionPrior)


def test_tune_mix_exclude_history_writes_the_excluding_services_prior(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"tune": "training.tune", "eval": "training.eval_cli"})
    root = tiny_bundle(tmp_path, n_users=60)
    base = ["--bundle", str(root), "--users", "20", "--dtype", "fp32", "--budget-minutes", "5"]
    mix_excl = ["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2", "--exclude-history"]
    assert cli.main(["tune", "prior", *base, "--trials", "2"]) == 0
    assert cli.main(mix_excl) == 2  # no BUNDLE/prior-excl yet: a clear error, nothing written
    assert cli.main(["tune", "prior", *base, "--trials", "2", "--exclude-history"]) == 0
    assert cli.main(mix_excl) == 0
    b = Bundle.open(root)
    meta = b.read()
    record = meta["tuning"]["mix_excl"]
    assert record["exclude_history"] and "mix" not in meta["tuning"]
    assert record["valid"]["ndcg@10"] >= record["valid_transition_only"]["ndcg@10"]
    excl = load_prior(b.prior_dir_for(True))
    assert b.prior_dir_for(True) != b.prior_dir and isinstance(excl, MixedPrior)
    assert meta["prior_excl"]["mix"] == pytest.approx(excl.mix.mix) == pytest.approx(record["settings"]["mix"])
    assert isinstance(load_prior(b.prior_dir), TransitionPrior)  # the keeping service's prior is untouched
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "10", "--dtype", "fp32",
                     "--baselines", "none", "--exclude-history", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prior"]["dir"] == "prior-excl" and res["prior"]["mix"] == pytest.approx(excl.mix.mix)
