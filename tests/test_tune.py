"""`recsvc tune prior|target` (Optuna) on tiny data: bounded, resumable, writes its choice into the bundle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401 (one_thread: a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.priors.transition import TransitionPrior
from recsvc.recommender.bundle_recommender import BundleRecommender

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    only_commands(monkeypatch, "tune")


def test_tune_prior_writes_the_best_trial_and_resumes(tmp_path, capsys) -> None:
    root = make_tiny_bundle(tmp_path, n_users=60)
    argv = ["tune", "prior", "--bundle", str(root), "--trials", "3", "--budget-minutes", "5", "--users", "20",
            "--dtype", "fp32"]
    assert cli.main(argv) == 0
    b = Bundle.open(root)
    record = b.read()["tuning"]["prior"]
    assert record["trials"] == 3 and record["trials_this_run"] == 3 and record["fit_on"] == "train"
    prior = TransitionPrior.load(b.prior_dir)  # the chosen settings, fitted on the bundle's periods
    assert {k: getattr(prior.settings, k) for k in record["settings"]} == record["settings"]
    assert b.read()["prior"]["weight"] == record["settings"]["weight"]
    # the first trial is the unfused model: the chosen one is at least as good on validation
    assert record["valid"][record["metric"]] >= record["valid_without_prior"][record["metric"]]
    # resumable: asking for 4 trials runs one more in the same study
    assert cli.main([*argv[:4], "--trials", "4", *argv[6:]]) == 0
    record = Bundle.open(root).read()["tuning"]["prior"]
    assert record["trials"] == 4 and record["trials_this_run"] == 1
    capsys.readouterr()
    assert cli.main([*argv[:4], "--trials", "0", *argv[6:]]) == 2
    assert "--trials" in capsys.readouterr().err


def test_tune_prior_on_every_validation_user(tmp_path) -> None:
    """``--users all`` (the recipe's): every validation user, the count recorded; a wrong count is refused."""
    from recsvc.data.split import load_split_dir

    root = make_tiny_bundle(tmp_path, n_users=30)
    argv = ["tune", "prior", "--bundle", str(root), "--trials", "1", "--budget-minutes", "5", "--users", "all",
            "--dtype", "fp32"]
    assert cli.main(argv) == 0
    b = Bundle.open(root)
    assert b.read()["tuning"]["prior"]["valid_users"] == len(load_split_dir(b.data_dir()).eval_users("valid"))
    with pytest.raises(SystemExit) as refused:  # argparse: "must be >= 1", exit code 2
        cli.main([*argv[:8], "--users", "0"])
    assert refused.value.code == 2


def test_a_search_whose_objective_changed_starts_afresh_instead_of_resuming(tmp_path) -> None:
    """The study resumes only what was scored on the same objective: other validation users, or a retrained
    target (new weights in the model directory the search ranks with), start a new study in the same file; the
    old trials, scored on another objective, are never compared with the new ones."""
    import os

    root = make_tiny_bundle(tmp_path, n_users=60)
    argv = ["tune", "prior", "--bundle", str(root), "--trials", "2", "--budget-minutes", "5", "--dtype", "fp32"]

    def tuned(*extra: str) -> dict:
        assert cli.main([*argv, *extra]) == 0
        return Bundle.open(root).read()["tuning"]["prior"]

    assert tuned("--users", "20")["trials_this_run"] == 2
    assert tuned("--users", "20")["trials_this_run"] == 0  # the same objective: resumed, nothing left to run
    other = tuned("--users", "15")  # other users: a new study, its own 2 trials
    assert other["trials_this_run"] == 2 and other["trials"] == 2 and other["valid_users"] == 15
    weights = next((root / "target").glob("*.safetensors"))  # a retrained target: its weights rewritten
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert tuned("--users", "20")["trials_this_run"] == 2


def test_tune_prior_with_history_excluded_writes_the_excluding_services_prior(tmp_path) -> None:
    root = make_tiny_bundle(tmp_path, n_users=60)
    base = ["tune", "prior", "--bundle", str(root), "--budget-minutes", "5", "--users", "20", "--dtype", "fp32"]
    assert cli.main([*base, "--trials", "2"]) == 0
    assert cli.main([*base, "--trials", "2", "--exclude-history"]) == 0
    # a separate study: the excluded search starts from scratch instead of resuming the other one's trials
    assert (root / "tune" / "prior.db").is_file() and (root / "tune" / "prior-excl.db").is_file()
    b = Bundle.open(root)
    record = b.read()["tuning"]["prior_excl"]
    assert record["exclude_history"] is True and record["trials"] == 2 and record["trials_this_run"] == 2
    assert record["valid"][record["metric"]] >= record["valid_without_prior"][record["metric"]]
    # written beside BUNDLE/prior, which keeps the other search's choice; excluding services fuse it
    assert b.read()["tuning"]["prior"]["exclude_history"] is False
    excl, kept = TransitionPrior.load(b.excluded_prior_dir), TransitionPrior.load(b.prior_dir)
    assert {k: getattr(excl.settings, k) for k in record["settings"]} == record["settings"]
    assert b.read()["prior"]["weight"] == kept.settings.weight
    assert b.prior_dir_for(True) == b.excluded_prior_dir and b.prior_dir_for(False) == b.prior_dir
    rec = BundleRecommender.from_bundle(root, dtype="fp32", exclude_history=True, use_drafter=False)
    assert rec.prior is not None and rec.prior.settings == excl.settings


def test_tune_target_one_trial(tmp_path) -> None:
    d = make_data(tmp_path, n_users=30)
    ids = write_ids(d, tmp_path / "ids.json")
    out = tmp_path / "tune"
    assert cli.main(["tune", "target", "--data", str(d), "--ids", str(ids), "--out", str(out), "--trials", "1",
                     "--epochs", "1", "--presets", "tiny", "--recall-users", "10", "--trial-minutes", "2"]) == 0
    best = json.loads((out / "best.json").read_text())
    assert best["trials"] == 1 and best["settings"]["preset"] == "tiny" and 0.0 <= best["valid_recall@10"] <= 1.0
    trial = Path(best["trial_dir"])
    assert trial == out / best["study"] / "trial-0" and Bundle.open(trial).is_done("target")
    trained = json.loads((Bundle.open(trial).target_dir / "training.json").read_text())
    assert trained["budget_plan"]["epochs"] == trained["schedule_epochs"] == 1  # sized to --trial-minutes, capped
    # the same objective resumes its study (nothing to run); a changed one (other ids) starts a new study in its own
    # directory, so trial 0 of the new study never resumes the old study's trial-0 checkpoints
    args = ["tune", "target", "--data", str(d), "--ids", str(ids), "--out", str(out), "--trials", "1", "--epochs",
            "1", "--presets", "tiny", "--recall-users", "10", "--trial-minutes", "2"]
    assert cli.main(args) == 0
    again = json.loads((out / "best.json").read_text())
    assert again["study"] == best["study"] and again["trials_this_run"] == 0 and again["trials"] == 1
    ids.write_text(ids.read_text() + "\n")  # the same ids, a rewritten file: another objective as far as it can tell
    assert cli.main(args) == 0
    other = json.loads((out / "best.json").read_text())
    assert other["study"] != best["study"] and other["trials_this_run"] == 1 and other["trials"] == 1
    assert Path(other["trial_dir"]).parent == out / other["study"] and trial.is_dir()
    assert cli.main(["tune", "target", "--data", str(d), "--ids", str(ids), "--out", str(out),
                     "--presets", "huge"]) == 2


def _hold_out_items(data_dir, items: set[int]) -> None:
    """Rewrite the train period so that ``items`` are first interacted with in valid / test (cold items)."""
    path = data_dir / "sequential_train.txt"
    lines = []
    for line in path.read_text().splitlines():
        user, *seq = line.split()
        kept = [i for i in seq if int(i) not in items] or [seq[0] if int(seq[0]) not in items else "1"]
        lines.append(" ".join([user, *kept]))
    path.write_text("\n".join(lines) + "\n")
    for split in ("valid", "test"):  # make sure the held-out items are targets somewhere
        p = data_dir / f"sequential_{split}.txt"
        rows = p.read_text().splitlines()
        rows = [r + " " + " ".join(map(str, sorted(items))) if n % 3 == 0 else r for n, r in enumerate(rows)]
        p.write_text("\n".join(rows) + "\n")


def test_tune_fresh_writes_the_slots_and_eval_reports_cold_and_warm(tmp_path, monkeypatch, capsys) -> None:
    only_commands(monkeypatch, "tune", "eval")
    root = make_tiny_bundle(tmp_path, n_users=60)
    _hold_out_items(tmp_path / "data", {3, 4, 5})
    assert cli.main(["tune", "fresh", "--bundle", str(root), "--dtype", "fp32",
                     "--embed-cache", str(tmp_path / "emb")]) == 0
    b = Bundle.open(root)
    record = b.read()["tuning"]["fresh"]
    assert record["valid_fresh_items"] == 3 and record["trials"] == 8 * 6 * 15  # slots x windows x thresholds
    assert record["settings"]["query"] == "mean" and record["query_fit"] == {"train": None, "served": None}
    # slots 0 is in the grid: the choice is at least as good on validation as the model alone, and the warm
    # slice loses less than one standard error of its figure
    assert record["valid"][record["metric"]] >= record["valid_without_fresh"][record["metric"]]
    assert 1 <= record["feasible_trials"] <= record["trials"]
    for key in ("recall@10", "ndcg@10"):
        assert record["valid"][f"warm_{key}_diff"] > -record["valid"][f"warm_{key}_se"] or (
            record["valid"][f"warm_{key}_diff"] == 0.0)
    from recsvc.content.fresh import FreshItems

    fresh = FreshItems.load(b.fresh_dir)
    assert fresh.fresh_ids.tolist() == [3, 4, 5] and fresh.settings.slots == record["settings"]["slots"]
    assert len(fresh.vectors.item_ids) == len(b.load_ids())
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "5,10", "--dtype", "fp32",
                     "--baselines", "popularity", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "cold Recall@10" in table and "warm Recall@10" in table
    res = json.loads(out.read_text())
    model = res["model"]
    assert model["cold"]["users"] > 0 and model["warm"]["users"] > 0 and res["cold_items"] == 3
    assert res["baselines"]["popularity"]["cold"]["recall@10"] == 0.0  # no interactions: never ranked
    # a third of the validation users have all three fresh items among their targets: slots pay
    assert fresh.settings.slots > 0
    if fresh.settings.slots:
        assert "popularity+fresh" in res["baselines"] and res["fresh"]["slots"] == fresh.settings.slots
        effect = res["fresh_effect"]["cold@10"]  # per-user differences with vs without the slots
        assert effect["users"] == model["cold"]["users"]
        assert effect["recall@10_diff"] == pytest.approx(model["cold"]["recall@10"]
                                                         - res["model_without_fresh"]["cold"]["recall@10"])


def test_tune_fresh_gate_rate_resolves_the_threshold_on_each_period(tmp_path, monkeypatch) -> None:
    only_commands(monkeypatch, "tune")
    root = make_tiny_bundle(tmp_path, n_users=60)
    _hold_out_items(tmp_path / "data", {3, 4, 5})
    assert cli.main(["tune", "fresh", "--bundle", str(root), "--dtype", "fp32", "--gate", "rate",
                     "--embed-cache", str(tmp_path / "emb")]) == 0
    from recsvc.content.fresh import FreshItems
    from recsvc.data.split import load_split_dir
    from training.tuning.fresh import RATES, SLOTS, WINDOWS

    b = Bundle.open(root)
    record = b.read()["tuning"]["fresh"]
    assert record["gate"] == "rate" and record["trials"] == len(SLOTS) * len(WINDOWS) * len(RATES)
    rate = record["settings"]["rate"]
    assert rate in RATES and "min_similarity" not in record["settings"]
    fresh = FreshItems.load(b.fresh_dir)
    assert fresh.settings.rate == rate and fresh.settings.slots == record["settings"]["slots"]
    # the served threshold is the rate resolved on the served fresh set over the served period's histories
    data = load_split_dir(tmp_path / "data")
    fit_on = record["counted_on"]
    assert fresh.settings.min_similarity == pytest.approx(record["served_min_similarity"])
    assert fresh.settings.min_similarity == pytest.approx(
        fresh.rate_threshold(list(data.sequences(fit_on).values()), rate))
    assert record["valid"]["min_similarity"] == pytest.approx(record["valid_min_similarity"])
    assert b.read()["fresh"]["min_similarity"] == pytest.approx(fresh.settings.min_similarity)


def test_tune_fresh_with_the_learned_query_fits_it_per_period_and_eval_reads_it(tmp_path, monkeypatch) -> None:
    only_commands(monkeypatch, "tune", "eval")
    root = make_tiny_bundle(tmp_path, n_users=60)
    _hold_out_items(tmp_path / "data", {3, 4, 5})
    args = ["tune", "fresh", "--bundle", str(root), "--dtype", "fp32", "--embed-cache", str(tmp_path / "emb"),
            "--queries", "mean,learned", "--query-epochs", "1"]
    assert cli.main([*args[:-1], "0"]) == 2 and cli.main([*args[:-3], "mean,fancy"]) == 2  # clear errors
    assert "tuning" not in Bundle.open(root).read() or "fresh" not in Bundle.open(root).read()["tuning"]
    assert cli.main(args) == 0
    b = Bundle.open(root)
    record = b.read()["tuning"]["fresh"]
    assert record["trials"] == 2 * 8 * 6 * 15 and set(record["best_by_query"]) == {"mean", "learned"}
    assert record["query_fit"]["train"]["period"] == "train" and record["query_fit"]["train"]["pairs"] > 0
    from recsvc.content.fresh import FreshItems, query_file

    assert query_file(b.fresh_dir, "train").is_file()  # for evaluations on valid
    fresh = FreshItems.load(b.fresh_dir)
    if record["settings"]["query"] == "learned":  # refitted on the served period
        assert record["query_fit"]["served"]["period"] == fresh.counted_on and fresh.query is not None
        assert fresh.query.fit["period"] == fresh.counted_on
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "10", "--dtype", "fp32",
                     "--baselines", "popularity", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["fresh"]["query"] == record["settings"]["query"] and res["fit_on"] == "train"


def test_tune_fresh_signals_chooses_on_valid_and_reports_test(tmp_path, monkeypatch, capsys) -> None:
    only_commands(monkeypatch, "tune")
    root = make_tiny_bundle(tmp_path, n_users=60)
    _hold_out_items(tmp_path / "data", {3, 4, 5})
    out = tmp_path / "signals.json"
    assert cli.main(["tune", "fresh-signals", "--bundle", str(root), "--embed-cache", str(tmp_path / "emb"),
                     "--top", "2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    from training.tuning.fresh_signals import LAMBDAS, MUS

    for split in ("valid", "test"):
        grid = record["grid"][split]
        assert len(grid) == len(MUS) * len(LAMBDAS) and all(0.0 <= g["share"] <= 1.0 for g in grid)
        assert record["counts"][split]["fresh_items"] >= 1
        demand = record["demand"][split]
        assert 0.0 <= demand["best_candidate_hit_rate"] <= 1.0 and 0.0 < demand["share_with_a_cold_target"] <= 1.0
    chosen = record["chosen"]
    best_valid = max(g["share"] for g in record["grid"]["valid"])
    assert chosen["both (valid's best pair)"]["valid"] == best_valid  # chosen on valid only
    assert chosen["similarity alone"]["mu"] == chosen["similarity alone"]["lambda"] == 0.0
    assert "| similarity alone |" in capsys.readouterr().out
    assert cli.main(["tune", "fresh-signals", "--bundle", str(root), "--top", "0"]) == 2


def test_fresh_signals_helpers_examples() -> None:
    import doctest

    import training.tuning.fresh_signals

    result = doctest.testmod(training.tuning.fresh_signals)
    assert result.attempted >= 4 and result.failed == 0


def _valid_repeats_history(data_dir) -> None:
    """Rewrite the valid period so that every user's valid target is an item of the user's train history."""
    train = {line.split()[0]: line.split()[1:] for line in (data_dir / "sequential_train.txt").read_text().splitlines()}
    path = data_dir / "sequential_valid.txt"
    rows = []
    for line in path.read_text().splitlines():
        user = line.split()[0]
        rows.append(" ".join([user, train[user][0]]) if train.get(user) else user)
    path.write_text("\n".join(rows) + "\n")


def test_tune_history_measures_both_lists_and_keeps_history_where_people_buy_again(tmp_path, monkeypatch,
                                                                                   capsys) -> None:
    """Valid targets that are all repeats of a history item: the excluding lists score exactly 0, so the bundle
    keeps history; the record is the paired measurement of both lists on the same users."""
    from training.tuning.history import decide

    only_commands(monkeypatch, "tune", "eval")
    root = make_tiny_bundle(tmp_path, n_users=60)
    _valid_repeats_history(tmp_path / "data")
    assert cli.main(["tune", "history", "--bundle", str(root), "--dtype", "fp32", "--users", "30"]) == 0
    b = Bundle.open(root)
    record = b.read()["tuning"]["history"]
    valid = record["valid"]
    assert record["valid_users"] == 30 and record["valid_targets_in_history"] == record["valid_targets"] > 0
    assert valid["exclude_recall@10"] == 0.0 and valid["exclude_ndcg@10"] == 0.0
    assert valid["ndcg@10_diff"] == pytest.approx(valid["exclude_ndcg@10"] - valid["keep_ndcg@10"])
    assert record["exclude_history"] is False and b.serves_excluding_history() is False
    assert record["exclude_history"] == decide(valid, "ndcg@10")
    assert "with the history items" in capsys.readouterr().out


def test_evaluation_and_service_follow_the_bundles_history_choice(tmp_path, monkeypatch, capsys) -> None:
    """bundle.json "exclude_history" (what `recsvc tune history` writes) is what `recsvc eval` applies to every
    method and what `recsvc serve` serves, unless --keep-history / --exclude-history say otherwise."""
    from recsvc.errors import UserError
    from recsvc.service.startup.settings import ServeSettings

    only_commands(monkeypatch, "eval")
    root = make_tiny_bundle(tmp_path, n_users=40)
    b = Bundle.open(root)
    assert b.serves_excluding_history() is False  # no choice recorded: keep them
    assert ServeSettings.for_bundle(str(root)).exclude_history is False
    b.update(exclude_history=True)
    served = ServeSettings.for_bundle(str(root))
    assert served.exclude_history is True and "--exclude-history" in served.argv()
    kept = ServeSettings.for_bundle(str(root), ["--keep-history"])
    assert kept.exclude_history is False and "--keep-history" in kept.argv()
    assert ServeSettings.for_bundle(str(root), kept.argv()) == kept  # the flags give the settings back
    rec = BundleRecommender.from_bundle(root, dtype="fp32", exclude_history=served.exclude_history,
                                        use_drafter=False)
    from recsvc.recommender.api import RecQuery

    history = Bundle.open(root).load_ids().item_ids.tolist()[:30]  # half the tiny catalog
    (result,) = rec.recommend([RecQuery(history=history, k=10)])
    assert len(result.item_ids) == 10 and not set(result.item_ids) & set(history)
    for flags, expected in (([], True), (["--keep-history"], False), (["--exclude-history"], True)):
        out = tmp_path / f"eval{len(flags)}{expected}.json"
        assert cli.main(["eval", "--bundle", str(root), "--split", "valid", "--k", "10", "--dtype", "fp32",
                         "--baselines", "popularity", "--max-users", "10", *flags, "--json", str(out)]) == 0
        assert json.loads(out.read_text())["exclude_history"] is expected
    assert "excluded for every method (the bundle is served so)" in capsys.readouterr().out
    b.update(exclude_history="yes")
    with pytest.raises(UserError, match="exclude_history"):
        b.serves_excluding_history()


def test_history_is_excluded_only_when_it_wins_by_more_than_its_noise() -> None:
    from recsvc.data.split import EvalUser
    from training.tuning.history import decide, paired

    assert decide({"ndcg@10_diff": 0.002, "ndcg@10_diff_se": 0.0005}, "ndcg@10")
    assert not decide({"ndcg@10_diff": 0.0004, "ndcg@10_diff_se": 0.0005}, "ndcg@10")
    assert not decide({"recall@10_diff": 0.0, "recall@10_diff_se": 0.0}, "recall@10")  # a tie keeps history
    users = [EvalUser(1, [5], [7]), EvalUser(2, [6], [6])]  # user 2 buys again what they have
    effect = paired({1: [7], 2: [8]}, {1: [6, 7], 2: [6]}, users, 10)
    assert effect["exclude_recall@10"] == 0.5 and effect["keep_recall@10"] == 1.0
    assert effect["recall@10_diff"] == -0.5
