"""The mixed prior (recsvc/priors/mixed.py): transition counts + a SASRec's softmax, stored and tuned."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.errors import UserError
from recsvc.priors.mixed import MixedPrior, MixSettings, SequenceModel, load_prior
from recsvc.priors.sasrec import SASRec
from recsvc.priors.transition import PriorSettings, TransitionPrior

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
    assert PriorSettings(weight=30.0).check().weight == 30.0  # tune mix searches up to 30 by default
    with pytest.raises(UserError, match="prior weight"):
        PriorSettings(weight=1001.0).check()


def test_the_product_term_multiplies_sasrecs_softmax_in_and_renormalises() -> None:
    """P ∝ mixture * softmax(s) ** product over the catalog; an item SASRec does not know gets the row's lowest
    SASRec probability in the product; a history of unknown items keeps the mixture; product 0 changes nothing."""
    trans, seq, mixed = _priors(0.3, 2.0)
    hist = [[1], [2, 3]]
    base = mixed.probs(hist)  # the mixture
    logq = torch.log_softmax(seq.scores(hist)[0], dim=-1).numpy()  # [2, 3] items 1, 2, 3 (temperature 1)
    q = np.exp(np.concatenate([logq, logq.min(axis=1, keepdims=True)], axis=1))  # item 4: the row's minimum
    for product in (0.5, 2.0):
        got = MixedPrior(trans, seq, MixSettings(0.3, 2.0, product=product)).probs(hist)
        expected = base * q ** product
        expected /= expected.sum(axis=1, keepdims=True)
        assert got.dtype == np.float32 and np.allclose(got, expected, atol=1e-6)
        assert np.allclose(got.sum(1), 1.0, atol=1e-5)
    # the product alone (mix 0) over the transition prior; zero transition mass stays zero
    p = trans.probs(hist)
    got = MixedPrior(trans, seq, MixSettings(0.0, 1.0, product=1.0)).probs(hist)
    expected = p * q / (p * q).sum(axis=1, keepdims=True)
    assert np.allclose(got, expected, atol=1e-6) and np.array_equal(got == 0, p == 0)
    assert np.allclose(MixedPrior(trans, seq, MixSettings(0.3, 2.0, product=1.0)).probs([[99]]), trans.probs([[99]]))
    assert np.array_equal(MixedPrior(trans, seq, MixSettings(0.3, 2.0, product=0.0)).probs(hist), base)
    with pytest.raises(UserError, match="out of range"):
        MixSettings(product=-0.1)


def test_a_live_catalogs_new_items_extend_the_mixed_prior() -> None:
    """A live catalog's additions (``with_items``): the transition part over the larger catalog, SASRec's part
    on the items it knows, a new item only the transition part; the mix (and ``alone``) kept."""
    _, seq, mixed = _priors(0.3, 2.0)
    mixed = mixed.with_settings(PriorSettings(beta=0.5, weight=1.0), MixSettings(0.3, 2.0, alone=True))
    trans = mixed.transition  # with a popularity back-off: a new item gets some mass
    grown = mixed.with_items([7, 2])
    assert isinstance(grown, MixedPrior) and grown.mix == mixed.mix and grown.mix.alone
    assert grown.item_ids.tolist() == [1, 2, 3, 4, 7] and mixed.with_items([1, 4]) is mixed
    hist = [[1], [2, 3]]
    expected = MixedPrior(trans.with_items([7]), seq, mixed.mix).probs(hist)
    got = grown.probs(hist)
    assert np.allclose(got, expected) and np.allclose(got.sum(1), 1.0, atol=1e-5)
    p_trans = trans.with_items([7]).probs(hist)
    assert got[0, 4] == pytest.approx(0.7 * p_trans[0, 4]) and got[0, 4] > 0  # the new item: transition part only


def test_tune_mix_writes_a_mixed_prior_that_serving_and_eval_load(tmp_path, monkeypatch, capsys) -> None:
    only_commands(monkeypatch, "tune", "eval", "prior")
    root = tiny_bundle(tmp_path, n_users=60)
    base = ["--bundle", str(root), "--users", "20", "--dtype", "fp32", "--budget-minutes", "5"]
    assert cli.main(["tune", "mix", *base, "--trials", "2"]) == 2  # no transition prior yet: a clear error
    assert cli.main(["tune", "prior", *base, "--trials", "2"]) == 0
    assert cli.main(["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2"]) == 0
    b = Bundle.open(root)
    record = b.read()["tuning"]["mix"]
    # two stages of --trials: the mixture and weight, then the transition settings and weight under the best mixture
    assert record["trials"] == 6 and record["valid"]["ndcg@10"] >= record["valid_transition_only"]["ndcg@10"]
    prior = load_prior(b.prior_dir)
    # validation decides whether the fused target or the prior's own best ranking is served (rank_by)
    alone = record["valid_prior_alone"]
    gated = alone["ndcg@10"] > record["valid"]["ndcg@10"]
    assert record["rank_by"] == ("prior" if gated else "fused") and 0.0 <= alone["recall@10"] <= 1.0
    assert ("the bundle now serves the prior's ranking" in capsys.readouterr().out) == gated
    picked = alone["settings"] if gated else record["settings"]
    assert isinstance(prior, MixedPrior) and prior.mix.mix == pytest.approx(picked["mix"]) and prior.mix.alone == gated
    assert prior.mix.product == pytest.approx(picked["product"]) and 0.0 <= picked["product"] <= 1.0
    assert b.read()["prior"]["product"] == pytest.approx(prior.mix.product)
    assert b.read()["prior"]["rank_by"] == record["rank_by"]
    assert prior.settings.weight == pytest.approx(record["settings"]["weight"])
    # the prior alone searched its own transition counts settings; a prior that ranks alone is served with them
    counts = alone["transition"]
    assert 1 <= counts["window"] <= 5 and 0.05 <= counts["decay"] <= 1.0 and 0.01 <= counts["beta"] <= 30.0
    served = counts if gated else record["settings"]
    assert (prior.settings.window, prior.settings.decay, prior.settings.beta) == pytest.approx(
        (served["window"], served["decay"], served["beta"]))
    assert b.read()["prior"]["window"] == served["window"] and b.read()["prior"]["beta"] == pytest.approx(
        served["beta"])
    # the weight is searched as the prior's share s of the fused score: w = s / (1 - s), s <= 30 / 31
    share = record["settings"]["share"]
    assert 0 <= share <= 30 / 31 and record["settings"]["weight"] == pytest.approx(share / (1 - share))
    assert cli.main(["tune", "mix", *base, "--trials", "3", "--max-weight", "1001"]) == 2
    assert (b.prior_dir / "sequence-train" / "model.safetensors").is_file()
    from recsvc.recommender.bundle_recommender import BundleRecommender

    rec = BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False)
    assert isinstance(rec.prior, MixedPrior)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "10", "--dtype", "fp32",
                     "--baselines", "none", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prior"]["mix"] == pytest.approx(prior.mix.mix)
    # resumed only on the same objective: again -> nothing to run; a wider weight range -> a new study
    assert cli.main(["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2"]) == 0
    assert Bundle.open(root).read()["tuning"]["mix"]["trials_this_run"] == 0
    # a prior refitted by hand since (other counts settings) is where the next search starts: a new study
    assert cli.main(["prior", "fit", "--bundle", str(root), "--window", "3", "--decay", "0.9", "--beta", "0.5",
                     "--weight", "1.0"]) == 0
    assert cli.main(["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2"]) == 0
    moved = Bundle.open(root).read()["tuning"]["mix"]
    assert moved["trials_this_run"] == 6 and moved["transition"]["window"] == 3
    assert moved["transition"]["decay"] == pytest.approx(0.9)
    assert cli.main(["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2", "--max-weight", "5"]) == 0
    again = Bundle.open(root).read()["tuning"]["mix"]
    assert again["trials_this_run"] == 6 and again["trials"] == 6
    # re-tuning the transition prior drops the stale mix
    assert cli.main(["tune", "prior", *base, "--trials", "3"]) == 0
    assert isinstance(load_prior(b.prior_dir), TransitionPrior)


def test_tune_mix_exclude_history_writes_the_excluding_services_prior(tmp_path, monkeypatch) -> None:
    only_commands(monkeypatch, "tune", "eval")
    root = tiny_bundle(tmp_path, n_users=60)
    base = ["--bundle", str(root), "--users", "20", "--dtype", "fp32", "--budget-minutes", "5"]
    mix_excl = ["tune", "mix", *base, "--trials", "3", "--sasrec-max-minutes", "0.2", "--exclude-history"]
    assert cli.main(mix_excl) == 2  # no BUNDLE/prior-excl yet: a clear error, nothing written
    assert cli.main(["tune", "prior", *base, "--trials", "2", "--exclude-history"]) == 0
    assert cli.main(mix_excl) == 0  # the excluding service's prior is all it needs (no BUNDLE/prior yet)
    assert cli.main(["tune", "prior", *base, "--trials", "2"]) == 0
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


def test_a_bundle_whose_prior_ranks_alone_serves_and_evaluates_the_priors_ranking(tmp_path, monkeypatch,
                                                                                  make_server) -> None:
    """``tune mix --rank-by prior`` (what ``auto`` picks when the prior's own ranking wins on validation): the
    recommender answers every mode with the prior's top-k (exclusions, the service's history exclusion, filters
    and caps honoured; no target forward), and ``recsvc eval`` scores that same ranking."""
    from recsvc.data.split import load_split_dir
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender
    from recsvc.recommender.prior_ranked import PRIOR_RANKED
    from recsvc.rules.spec import Cap, Rules, ValueFilter
    from recsvc.service.startup.settings import ServeSettings, build_recommender
    from training.baselines.prior_alone import prior_rankings

    only_commands(monkeypatch, "tune", "eval", "bundle", "serve")
    root = tiny_bundle(tmp_path, n_users=60)
    base = ["--bundle", str(root), "--users", "20", "--dtype", "fp32", "--budget-minutes", "5"]
    assert cli.main(["tune", "prior", *base, "--trials", "2"]) == 0
    mix = ["tune", "mix", *base, "--trials", "2", "--sasrec-max-minutes", "0.2"]
    assert cli.main([*mix, "--rank-by", "prior"]) == 0
    b = Bundle.open(root)
    assert b.read()["tuning"]["mix"]["rank_by"] == "prior" and b.read()["prior"]["rank_by"] == "prior"
    prior = load_prior(b.prior_dir)
    assert isinstance(prior, MixedPrior) and prior.mix.alone
    rec = BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False, use_fresh=False)
    assert rec.prior_ranks and not rec.prefill_ahead_enabled
    # a server of that bundle neither compiles the target's forward nor calibrates speculation at start-up
    events: list[str] = []
    forward = "compiled" if shutil.which("g++") or shutil.which("clang++") else "fast"
    served = build_recommender(ServeSettings.from_args(cli.build_parser().parse_args(
        ["serve", "--bundle", str(root), "--dtype", "fp32", "--spec", "auto", "--forward", forward])),
        step=lambda event, **_: events.append(event))
    assert served.prior_ranks and served.drafter is not None and "target_unused" in events
    assert not {"compiling_forward", "forward_compiled"} & set(events)
    assert not [e for e in events if e.startswith(("calibration", "speculation"))]
    data_users = load_split_dir(b.resolve_data_dir(None)).eval_users("valid")[:5]
    expected = prior_rankings(prior, data_users, 5)
    for mode in ("plain", "strict", "relaxed"):
        got = rec.recommend([RecQuery(history=u.history, k=5, mode=mode) for u in data_users])
        assert [r.item_ids for r in got] == [expected[u.user_id] for u in data_users]
        assert all(r.stats.target_calls == 0 and r.decoding is not None and r.decoding.fallback == PRIOR_RANKED
                   for r in got)
        p = prior.probs([data_users[0].history])[0]
        rows = [int(np.searchsorted(prior.item_ids, i)) for i in got[0].item_ids]
        assert got[0].scores == pytest.approx(np.log(p[rows]).tolist())
    # through a real gRPC server: the prior's items, reported as plain decoding that the prior ranked
    from recsvc.client.client import RecClient

    server = make_server(rec)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        response = client.recommend("u", history=data_users[0].history, k=5, mode="strict")
    assert [i.item_id for i in response.items] == expected[data_users[0].user_id]
    assert response.stats.mode_fallback_reason == PRIOR_RANKED and response.stats.target_forward_calls == 0
    # exclusions: the query's own, and the history when the service excludes it
    user = data_users[0]
    top = expected[user.user_id]
    out = rec.recommend([RecQuery(history=user.history, k=5, mode="plain", exclude=top[:2])])[0]
    assert out.item_ids == prior_rankings(prior, [user], 7)[user.user_id][2:7] and not set(top[:2]) & set(out.item_ids)
    excl = BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False, use_fresh=False,
                                         exclude_history=True)
    kept = excl.recommend([RecQuery(history=user.history, k=5, mode="plain")])[0].item_ids
    assert kept == prior_rankings(prior, [user], 5, exclude_history=True)[user.user_id]
    # rules: a deny filter and a cap, over the items' attributes
    assert cli.main(["bundle", "attributes", "--bundle", str(root), "--from-title"]) == 0
    rec = BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False, use_fresh=False)
    brand = rec.rule_catalog.attrs.values["brand"]
    first = brand[top[0]][0]
    ruled = rec.recommend([RecQuery(history=user.history, k=5, mode="plain", rules=Rules(
        deny=(ValueFilter("brand", frozenset({first})),), caps=(Cap("brand", 1),)))])[0].item_ids
    assert ruled and all(brand[i][0] != first for i in ruled)
    assert len({brand[i][0] for i in ruled}) == len(ruled)  # at most one item per brand
    # recsvc eval scores the served ranking: the model row is the prior-alone row
    out_json = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "10", "--dtype", "fp32",
                     "--baselines", "none", "--no-fresh", "--json", str(out_json)]) == 0
    res = json.loads(out_json.read_text())
    assert res["recall@10"] == res["prior_alone"]["recall@10"]
    assert res["ndcg@10"] == res["prior_alone"]["ndcg@10"]
    # forcing the fused search back
    assert cli.main([*mix, "--rank-by", "fused"]) == 0
    assert not load_prior(b.prior_dir).mix.alone
    assert not BundleRecommender.from_bundle(root, dtype="fp32", use_drafter=False).prior_ranks


def test_sasrec_eval_last_hidden_is_the_modules_computation() -> None:
    """The eval-mode fast path (functional ops, the last block at the last positions only) gives the module
    path's hidden states up to float rounding, for right-padded batches of mixed lengths and a single row."""
    torch.manual_seed(0)
    for heads, blocks in ((1, 2), (2, 3)):
        model = SASRec(50, hidden=16, blocks=blocks, heads=heads, dropout=0.3, max_len=12).eval()
        seqs = torch.randint(1, 51, (5, 12))
        lengths = torch.tensor([12, 1, 7, 3, 12])
        for b, n in enumerate(lengths.tolist()):
            seqs[b, n:] = 0
        with torch.inference_mode():
            fast = model.last_hidden(seqs, lengths)
            full = model.hidden_states(seqs)[torch.arange(5), lengths - 1]
            one = model.last_hidden(seqs[2:3, :7], lengths[2:3])
        assert fast.shape == (5, 16)
        torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(one[0], full[2], atol=1e-5, rtol=1e-5)
        model.train()  # training keeps the module path (dropout on): not the eval path's numbers
        assert not torch.allclose(model.last_hidden(seqs, lengths), fast)


@pytest.mark.parametrize("fresh", [True, False])
def test_the_torch_prior_matches_the_numpy_reference(fresh: bool) -> None:
    """``MixedPrior.probs`` (float32 torch) == ``ReferenceMixedPrior.probs`` (numpy, the product in float64) up to
    float32 rounding, with a fresh item SASRec does not know (a gather / scatter between their rows) and without
    (SASRec's rows are the catalog's), for known and unknown histories, mixture and product on or off."""
    from recsvc.priors.reference import ReferenceMixedPrior

    rng = np.random.default_rng(0)
    catalog = list(range(1, 41))
    seqs = [rng.choice(catalog[:-1] if fresh else catalog, size=6).tolist() for _ in range(30)]
    trans = TransitionPrior.fit(seqs, catalog, PriorSettings(window=3, decay=0.5, beta=0.5, weight=1.0))
    known = catalog[:-1] if fresh else catalog
    torch.manual_seed(0)
    seq = SequenceModel(SASRec(len(known), hidden=8, blocks=1, max_len=5), np.array(known), 5)
    hist = [[1, 2, 3], [5], [99], [40, 7], []]
    for mix in (MixSettings(0.3, 2.0), MixSettings(0.0, 1.0, 0.7), MixSettings(0.4, 0.5, 1.5),
                MixSettings(0.0, 1.0, 0.0)):
        served = MixedPrior(trans, seq, mix)
        assert served._same_rows is not fresh
        got, want = served.probs(hist), ReferenceMixedPrior.of(served).probs(hist)
        assert got.dtype == np.float32 and got.shape == (len(hist), len(catalog))
        assert np.allclose(got, want, rtol=1e-5, atol=1e-7)
        assert np.array_equal(got.argsort(axis=1, kind="stable")[:, -5:], want.argsort(axis=1, kind="stable")[:, -5:])
        assert np.array_equal(served.probs([]), np.zeros((0, len(catalog)), np.float32))
