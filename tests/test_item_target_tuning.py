"""The item-level target through the validation searches and the evaluation: its ranker's forced pass and wide
beam agree with its search, re-scored trials equal full decodes, and a bundle built by `recsvc train items --bundle`
goes through `recsvc tune prior`, `recsvc tune mix` and `recsvc eval` like a token bundle."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_timeline_search import tiny_catalog, tiny_model
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.data.metrics import evaluate_rankings
from recsvc.data.split import EvalUser
from recsvc.priors.transition import PriorSettings, TransitionPrior
from recsvc.timeline.search import beam_search, exhaustive_scores, user_states
from training.evaluation.rankers import TimelineRanker
from training.tuning.rescore import PriorTables, Rescorer, SearchTables
from training.tuning.rescore_cache import Widths, build_candidates

pytestmark = pytest.mark.usefixtures("one_thread")


def users_of(trie, n: int = 12, seed: int = 0) -> list[EvalUser]:
    rng = np.random.default_rng(seed)
    items = trie.ids.item_ids
    return [EvalUser(u, rng.choice(items, size=int(rng.integers(1, 8))).tolist(),
                     rng.choice(items, size=2, replace=False).tolist()) for u in range(1, n + 1)]


def test_forced_pass_and_wide_beam_agree_with_the_search():
    trie = tiny_catalog(n=40, seed=2)
    ranker = TimelineRanker(tiny_model(trie, 2), trie)
    users = users_of(trie)
    histories = [u.history for u in users]
    states = user_states(ranker.model, trie, histories)
    beams = ranker.wide_beam(histories, 7, None)
    leaves, partial = beams[-1]
    assert torch.equal(leaves, beam_search(ranker.model, trie, states, 7).leaves)
    forced = ranker.leaf_logprobs(histories, leaves)
    assert torch.allclose(forced, partial, atol=1e-5)
    rows = [[int((trie.item_path[:, -1] == x).nonzero()[0]) for x in row] for row in leaves.tolist()]
    full = exhaustive_scores(ranker.model, trie, states)
    assert torch.allclose(forced[..., -1], torch.stack([full[b, r] for b, r in enumerate(rows)]), atol=1e-5)
    padded = leaves.clone()
    padded[0, 0] = -1
    assert bool((ranker.leaf_logprobs(histories, padded)[0, 0] == float("-inf")).all())


@pytest.mark.parametrize("exclude", [False, True])
def test_rescored_trials_equal_full_decodes(exclude):
    """Candidates covering the catalog and the served width pruning: the replayed search's lists are the fused
    search's, user for user, for several prior settings."""
    trie = tiny_catalog(n=40, seed=3)
    ranker = TimelineRanker(tiny_model(trie, 3), trie)
    users = users_of(trie, seed=3)
    prior = TransitionPrior.fit([u.history + u.targets for u in users], trie.ids.item_ids.tolist(), fitted_on="train")
    cands = build_candidates(ranker, trie, users, prior, Widths(beam=len(trie.ids), prior=0), exclude)
    tables, search = PriorTables.build(prior, trie, users, cands), SearchTables.build(prior, trie, users, cands)
    for width in (5, 12):
        scorer = Rescorer(cands, tables, users, k=5, search=search, width=width)
        for st in (PriorSettings(weight=0.0), PriorSettings(window=2, decay=0.5, beta=1.0, weight=0.8),
                   PriorSettings(window=4, decay=0.3, beta=0.05, weight=2.5)):
            decoded = ranker.lists(users, 5, width, exclude, prior.with_settings(st))
            assert scorer.lists(st) == decoded, (width, st)
            full = evaluate_rankings(decoded, users, (5,))
            assert scorer.evaluate(st)["ndcg@5"] == pytest.approx(full["ndcg@5"], abs=1e-12)


def test_items_bundle_through_tune_and_eval(tmp_path, capsys):
    data = make_data(tmp_path, n_users=60)
    ids = write_ids(data, tmp_path / "ids.json")
    out = tmp_path / "bundle"
    assert cli.main(["build", "--data", str(data), "--out", str(out), "--ids", str(ids), "--stages", "ids"]) == 0
    train = ["train", "items", "--bundle", str(out), "--epochs", "2", "--hidden", "16", "--heads", "2",
             "--batch-size", "16", "--bf16", "off", "--patience", "0"]
    assert cli.main(train) == 0
    b = Bundle.open(out)
    meta = b.read()
    assert meta["architecture"] == "items" and meta["protocol"] == "deploy" and b.is_done("target")
    assert (b.train_only_target_dir / "timeline.json").is_file() and (b.target_dir / "timeline.safetensors").is_file()
    assert meta["stages"]["target"]["refit"]["epochs"] == meta["stages"]["target"]["selection"]["chosen_epoch"]
    assert cli.main(["tune", "prior", "--bundle", str(out), "--trials", "3", "--users", "all"]) == 0
    assert cli.main(["tune", "mix", "--bundle", str(out), "--trials", "2", "--sasrec-max-minutes", "0.2",
                     "--cache-dir", str(tmp_path / "baselines")]) == 0
    assert cli.main(["tune", "history", "--bundle", str(out), "--users", "30"]) == 0
    assert cli.main(["tune", "fresh", "--bundle", str(out), "--gate", "rate", "--embed-cache",
                     str(tmp_path / "emb")]) == 0
    meta = b.read()
    assert "target_over_prior" in meta and meta["tuning"]["mix"]["check"]["users"] > 0
    assert {"history", "fresh"} <= set(meta["tuning"])
    capsys.readouterr()
    report = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(out), "--split", "test", "--k", "10", "--baselines", "popularity",
                     "--json", str(report)]) == 0
    assert "ndcg@10" in json.dumps(json.loads(report.read_text()))
