"""The transition prior end to end on a real tiny bundle: `recsvc prior fit` writes BUNDLE/prior, the served
recommender fuses it (plain == strict, both equal to the engine given the prior by hand), `exclude_history`
removes history items, `recsvc eval` reports the prior, and bad input exits 2."""

from __future__ import annotations

import json

import pytest
import torch
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.data.split import load_split_dir
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.priors.transition import TransitionPrior
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender
from training.evaluation.baselines import format_table

pytestmark = pytest.mark.usefixtures("one_thread")
WEIGHT = 4.0


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    """The real entry point, limited to the groups under test (others may be mid-edit)."""
    only_commands(monkeypatch, "prior", "serve")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = make_tiny_bundle(tmp_path_factory.mktemp("prior"), n_users=60)
    assert cli.main(["prior", "fit", "--bundle", str(root), "--weight", str(WEIGHT)]) == 0
    return root


@pytest.fixture(scope="module")
def rec(bundle):
    return BundleRecommender.from_bundle(bundle, dtype="fp32")


@pytest.fixture(scope="module")
def unfused(bundle):
    return BundleRecommender.from_bundle(bundle, dtype="fp32", use_prior=False, use_drafter=False)


def histories(bundle, n: int = 6) -> list[list[int]]:
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    return [u.history[-10:] for u in data.eval_users("valid")[:n]]


def test_prior_fit_writes_the_prior_and_records_it(bundle, tmp_path, capsys) -> None:
    b = Bundle.open(bundle)
    assert (b.prior_dir / "transition.safetensors").is_file() and (b.prior_dir / "prior.json").is_file()
    assert b.read()["prior"] == {"window": 1, "decay": 0.5, "beta": 1.0, "weight": WEIGHT, "fit_on": "train"}
    prior = TransitionPrior.load(b.prior_dir)
    data = load_split_dir(b.resolve_data_dir())
    assert prior.item_ids.tolist() == b.load_ids().item_ids.tolist() and prior.fitted_on == "train"
    assert prior.counts.sum() == sum(max(0, len(s) - 1) for s in data.train.values())
    # a deploy-protocol bundle counts train + valid ("auto"); --fit-on overrides; settings are recorded
    other = tmp_path / "copy"
    import shutil

    shutil.copytree(bundle, other, ignore=shutil.ignore_patterns("target", "drafter", "prior"))
    Bundle.open(other).update(protocol="deploy")
    assert cli.main(["prior", "fit", "--bundle", str(other), "--window", "2", "--beta", "0.5"]) == 0
    deploy = TransitionPrior.load(Bundle.open(other).prior_dir)
    assert deploy.fitted_on == "train+valid" and deploy.counts.sum() > prior.counts.sum()
    assert Bundle.open(other).read()["prior"] == {"window": 2, "decay": 0.5, "beta": 0.5, "weight": 1.0,
                                                  "fit_on": "train+valid"}
    assert cli.main(["prior", "fit", "--bundle", str(other), "--fit-on", "train"]) == 0
    assert TransitionPrior.load(Bundle.open(other).prior_dir).counts.sum() == prior.counts.sum()
    assert "transitions" in capsys.readouterr().out


def test_bad_input_exits_2(bundle, tmp_path, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["prior", "fit", "--bundle", str(bundle), "--window", "0"]) == 2
    assert "error: prior window" in capsys.readouterr().err
    assert cli.main(["prior", "fit", "--bundle", str(bundle), "--weight", "-1"]) == 2
    assert "error: prior weight" in capsys.readouterr().err
    assert cli.main(["prior", "fit", "--bundle", str(tmp_path / "nowhere")]) == 2
    assert "error: not a bundle" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["prior", "fit", "--bundle", str(bundle), "--fit-on", "everything"])
    assert exc.value.code == 2
    assert cli.main(["prior"]) == 2  # no subcommand: help, exit 2
    assert Bundle.open(bundle).read()["prior"]["weight"] == WEIGHT  # failed runs changed nothing


def test_served_recommender_fuses_the_bundles_prior(bundle, rec, unfused) -> None:
    assert rec.prior is not None and rec.prior_weight == WEIGHT and unfused.prior is None
    hist = histories(bundle)
    plain = rec.recommend([RecQuery(h, k=5, mode="plain") for h in hist])
    strict = rec.recommend([RecQuery(h, k=5, mode="strict") for h in hist])
    base = unfused.recommend([RecQuery(h, k=5, mode="plain") for h in hist])
    # the engine given the prior by hand
    batch = PromptBatch.from_lists([rec.prompts.prompt_ids(h) for h in hist])
    fused = prior_log_mass(rec.trie, torch.from_numpy(rec.prior.probs(hist)), WEIGHT)
    ref = rec.engine.search(batch, 5, None, fused)
    for r in range(len(hist)):
        assert plain[r].item_ids == rec.trie.leaf_items(ref.leaves[r])
        assert plain[r].scores == ref.scores[r].tolist()
        assert strict[r].item_ids == plain[r].item_ids  # lossless with the prior too
        assert [round(s, 4) for s in strict[r].scores] == [round(s, 4) for s in plain[r].scores]
    assert any(p.item_ids != b.item_ids for p, b in zip(plain, base, strict=True))  # the prior matters
    # relaxed mode samples from the fused distributions: seeded, reproducible
    q = RecQuery(hist[0], k=5, mode="relaxed", seed=5)
    a, b = rec.recommend([q, q])
    assert a.item_ids == b.item_ids and len(a.item_ids) == 5


def test_exclude_history_removes_history_items(bundle, unfused) -> None:
    hist = histories(bundle, 3)
    first = unfused.recommend([RecQuery(h, k=5) for h in hist])
    # histories made of each user's own top-3 recommendations: the option must remove exactly those
    own = [h + r.item_ids[:3] for h, r in zip(hist, first, strict=True)]
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", use_prior=False, use_drafter=False,
                                        exclude_history=True)
    kept = unfused.recommend([RecQuery(h, k=5) for h in own])
    out = rec.recommend([RecQuery(h, k=5) for h in own] + [RecQuery(h, k=5, mode="relaxed", seed=1) for h in own])
    assert any(set(r.item_ids) & set(h) for r, h in zip(kept, own, strict=True))  # they would be recommended
    for r, h in zip(out, own + own, strict=True):
        assert len(r.item_ids) == 5 and not set(r.item_ids) & set(h)
    # a query may choose for itself: False lets the history in on an excluding recommender, True leaves it out on
    # a keeping one
    back = rec.recommend([RecQuery(h, k=5, exclude_history=False) for h in own])
    assert [r.item_ids for r in back] == [r.item_ids for r in kept]
    out_again = unfused.recommend([RecQuery(h, k=5, exclude_history=True) for h in own])
    assert [r.item_ids for r in out_again] == [r.item_ids for r in out[:len(own)]]


def test_serve_flags(bundle) -> None:
    import argparse

    from recsvc.service import cli as serve_cli
    from recsvc.service.startup import process

    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--bundle", str(bundle), "--dtype", "fp32", "--spec", "2:1",
                              "--exclude-history", "--no-prior"])
    rec = process.load_recommender(args)
    assert rec.exclude_history and rec.prior is None
    args = parser.parse_args(["serve", "--bundle", str(bundle), "--dtype", "fp32", "--spec", "2:1"])
    rec = process.load_recommender(args)
    assert not rec.exclude_history and rec.prior_weight == WEIGHT


def test_evaluation_fuses_and_reports_the_prior(bundle) -> None:
    from training.evaluation.evaluate import evaluate_bundle, make_evaluator

    with_prior = evaluate_bundle(bundle, "valid", (5,), dtype="fp32", max_users=12)
    without = evaluate_bundle(bundle, "valid", (5,), dtype="fp32", max_users=12, use_prior=False)
    assert with_prior["prior"] == {"window": 1, "decay": 0.5, "beta": 1.0, "weight": WEIGHT, "fitted_on": "train",
                                   "dir": "prior"}
    assert without["prior"] is None
    # the fused prior read alone, on the same users and metric code: what the generative model adds
    alone = with_prior["prior_alone"]
    assert set(alone) >= {"recall@5", "ndcg@5", "cold", "warm"} and without["prior_alone"] is None
    assert "served prior alone" in format_table(with_prior)
    json.dumps(with_prior)  # the CLI writes it as JSON
    b = Bundle.open(bundle)
    data = load_split_dir(b.resolve_data_dir())
    prior = TransitionPrior.load(b.prior_dir)
    evaluate = make_evaluator(b.prompt_builder(), data, ks=(5,), max_users=12, prior=prior)
    assert {"recall@5", "ndcg@5"} <= set(evaluate(b.load_target(dtype="fp32")))
