"""`recsvc eval --against` (one bundle against another, or against itself less a part) and `recsvc eval summarize`
(the mean of several runs' ratios), on tiny real bundles: a random "tiny" target over a synthetic split in which
three items appear only after the train period (the cold slice), with two fresh slots of random item vectors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_drafter_fixtures import tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (one_thread: a fixture)
from test_tune import _hold_out_items

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.content.fresh import FreshItems, FreshSettings, ItemVectors
from training.evaluation.lead import paired_lead
from training.evaluation.paired import SLICES, scores_from_payload

pytestmark = pytest.mark.usefixtures("one_thread")
COLD = {3, 4, 5}
ARGS = ["--split", "test", "--k", "5,10", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    """``a``: the tiny bundle with fresh slots; ``copy``: a byte copy of it; ``seed1``: the same bundle with a
    target drawn from another seed (what a second training seed gives: other lists on the same users)."""
    from recsvc.bundle.loading import save_causal_lm
    from recsvc.bundle.presets import new_model

    root = tmp_path_factory.mktemp("compare")
    a = tiny_bundle(root, n_users=60)
    _hold_out_items(root / "data", COLD)
    bundle = Bundle.open(a)
    items = bundle.load_ids().item_ids.tolist()
    vectors = ItemVectors.from_arrays(items, np.random.default_rng(0).normal(size=(len(items), 8)))
    FreshItems(vectors, sorted(COLD), FreshSettings(slots=2, window=1, min_similarity=-1.0)).save(bundle.fresh_dir)
    copy = root / "copy"
    shutil.copytree(a, copy)
    seed1 = root / "seed1"
    shutil.copytree(a, seed1)
    tok = Bundle.open(seed1).load_tokenizer()
    save_causal_lm(new_model("tiny", tok, seed=1), Bundle.open(seed1).target_dir)
    return {"a": a, "copy": copy, "seed1": seed1}


@pytest.fixture(scope="module")
def runs(bundles, tmp_path_factory) -> dict[str, Path]:
    """Eval JSON: ``a`` against its copy (popularity and SASRec beside), ``seed1`` alone, ``a`` on valid."""
    out = tmp_path_factory.mktemp("runs")
    files = {name: out / f"{name}.json" for name in ("a", "seed1", "valid", "kept")}
    base = ["--baselines", "popularity,sasrec", "--sasrec-max-minutes", "0.02",
            "--cache-dir", str(out / "sasrec")]
    assert cli.main(["eval", "--bundle", str(bundles["a"]), *ARGS, *base, "--against", str(bundles["copy"]),
                     "--against-label", "copy", "--json", str(files["a"])]) == 0
    assert cli.main(["eval", "--bundle", str(bundles["seed1"]), *ARGS, *base, "--json", str(files["seed1"])]) == 0
    assert cli.main(["eval", "--bundle", str(bundles["a"]), "--split", "valid", "--k", "5,10", "--dtype", "fp32",
                     "--baselines", "popularity", "--json", str(files["valid"])]) == 0
    return files


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_a_bundle_against_its_copy_leads_by_exactly_one_on_every_slice(runs) -> None:
    res = _read(runs["a"])
    block = res["against"]
    assert block["label"] == "copy" and block["variant"] is None and block["parts"] == {
        "prior": True, "dense": True, "fresh": True}
    assert block["fresh"]["slots"] == 2 and block["metrics"]["recall@10"] == res["model"]["recall@10"]
    assert set(block["lead"]) == set(SLICES) and res["model"]["cold"]["users"] > 0
    for part in SLICES:
        assert set(block["lead"][part]) == {"recall@5", "ndcg@5", "recall@10", "ndcg@10"}
        for r in block["lead"][part].values():
            assert r["diff"] == 0.0 and r["diff_se"] == 0.0
            assert r["ratio"] is None or r["ratio"] == r["ratio_lo"] == r["ratio_hi"] == 1.0
    assert block["lead"]["all"]["recall@10"]["ratio"] == 1.0  # the tiny target hits some targets
    assert res["paired"][-1] == {"model": "model", "baseline": "against", "slices": block["lead"]}


def test_the_table_and_json_carry_the_headline_and_the_comparison(runs, bundles, capsys) -> None:
    res = _read(runs["a"])
    h = res["headline"]
    assert h["k"] == 10 and h["baseline"] == "sasrec"
    served, warm = h["served_vs_baseline"], h["own_vs_baseline_warm"]
    assert (served["model"], served["baseline"], served["slice"]) == ("model", "sasrec+fresh", "all")
    assert (warm["model"], warm["baseline"], warm["slice"]) == ("model_without_fresh", "sasrec", "warm")
    assert served["recall"] == res["lead"]["sasrec+fresh"]["recall@10"]
    assert served["ndcg"]["model"] == pytest.approx(res["model"]["ndcg@10"])
    assert warm["recall"]["model"] == pytest.approx(res["model_without_fresh"]["warm"]["recall@10"])
    assert warm["recall"]["baseline"] == pytest.approx(res["baselines"]["sasrec"]["warm"]["recall@10"])
    assert h["cold"]["own_recall"] == res["model_without_fresh"]["cold"]["recall@10"]
    assert h["cold"]["served_recall"] == res["model"]["cold"]["recall@10"]
    assert h["cold"]["users"] == res["model"]["cold"]["users"] > 0
    # every comparison on every slice; the per-user scores give back the table's means
    pairs = {(r["model"], r["baseline"]) for r in res["paired"]}
    assert {("model", "sasrec+fresh"), ("model_without_fresh", "sasrec"), ("model_without_fresh", "popularity"),
            ("model", "against")} <= pairs
    for method, figures in (("model", res["model"]), ("model_without_fresh", res["model_without_fresh"]),
                            ("sasrec+fresh", res["baselines"]["sasrec+fresh"])):
        scores = scores_from_payload(res["per_user"], method)
        assert scores["all"]["ndcg@10"].mean() == pytest.approx(figures["ndcg@10"])
        assert scores["cold"]["recall@5"].mean() == pytest.approx(figures["cold"]["recall@5"])
    assert len(res["per_user"]["users"]["all"]) == res["users"]
    # the printed table, again from the same bundles (a variant: the copy without its slots)
    capsys.readouterr()
    assert cli.main(["eval", "--bundle", str(bundles["a"]), *ARGS, "--baselines", "none",
                     "--against", str(bundles["copy"]), "--against-variant", "no-slots"]) == 0
    out = capsys.readouterr().out
    assert "headline at 10" in out and "cold slice (" in out
    assert "A / B, paired per user" in out and "B = copy no-slots" in out
    assert "| recall@10 |" in out and "| ndcg@5 |" in out


def test_the_variant_without_slots_is_the_models_own_lists(bundles, tmp_path) -> None:
    out = tmp_path / "v.json"
    assert cli.main(["eval", "--bundle", str(bundles["a"]), *ARGS, "--baselines", "none",
                     "--against-variant", "no-slots", "--json", str(out)]) == 0
    res = _read(out)
    block = res["against"]
    assert block["variant"] == "no-slots" and block["fresh"] is None and block["parts"]["fresh"] is False
    assert block["metrics"] == res["model_without_fresh"]
    for k in (5, 10):  # A / B on the cold slice is what the slots add there
        effect = res["fresh_effect"][f"cold@{k}"]
        assert block["lead"]["cold"][f"recall@{k}"]["diff"] == pytest.approx(effect[f"recall@{k}_diff"])
    assert res["headline"]["served_vs_baseline"] is None  # no baselines asked


@pytest.mark.parametrize("argv, message", [
    (["--against-variant", "no-dense"], "has no dense head"),
    (["--against-variant", "no-prior"], "has no prior"),
    (["--against-label", "x"], "--against-label needs --against"),
    (["--against", "{missing}"], "not a bundle"),
])
def test_comparisons_that_cannot_be_made_exit_2(bundles, tmp_path, capsys, argv, message) -> None:
    argv = [a.format(missing=tmp_path / "nothing") for a in argv]
    assert cli.main(["eval", "--bundle", str(bundles["a"]), *ARGS, "--baselines", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_summarize_averages_the_runs_ratios_with_a_joint_interval(runs, tmp_path, capsys) -> None:
    out = tmp_path / "summary.json"
    assert cli.main(["eval", "summarize", str(runs["a"]), str(runs["seed1"]), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 runs, test split" in printed and "served lists vs sasrec+fresh" in printed
    summary = _read(out)
    a, s1 = _read(runs["a"]), _read(runs["seed1"])
    # the comparison with --against is in one run only: left out, and said so
    assert ["model", "against"] in summary["not_in_every_run"]
    entry = next(p for p in summary["pairs"] if (p["model"], p["baseline"]) == ("model", "sasrec+fresh"))
    for key in ("recall@10", "ndcg@10"):
        cell = entry["slices"]["all"][key]
        ratios = [run["lead"]["sasrec+fresh"][key]["ratio"] for run in (a, s1)]
        assert [r["ratio"] for r in cell["runs"]] == ratios
        assert cell["mean"]["ratio"] == pytest.approx(sum(ratios) / 2)
        assert cell["mean"]["ratio_lo"] <= cell["mean"]["ratio"] <= cell["mean"]["ratio_hi"]
    h = summary["headline"]
    assert h["served_vs_baseline"]["baseline"] == "sasrec+fresh" and h["own_vs_baseline_warm"]["slice"] == "warm"
    assert h["cold"]["own_recall"]["runs"] == [a["headline"]["cold"]["own_recall"],
                                               s1["headline"]["cold"]["own_recall"]]
    # one run summarized with itself: the joint interval is that run's own paired interval
    assert cli.main(["eval", "summarize", str(runs["a"]), str(runs["a"]), "--json", str(out)]) == 0
    same = next(p for p in _read(out)["pairs"] if p["baseline"] == "sasrec")["slices"]["warm"]["recall@10"]
    scores = {m: scores_from_payload(a["per_user"], m)["warm"]["recall@10"] for m in ("model", "sasrec")}
    own = paired_lead(scores["model"], scores["sasrec"])
    assert (same["mean"]["ratio_lo"], same["mean"]["ratio_hi"]) == pytest.approx((own["ratio_lo"], own["ratio_hi"]))


def test_summarize_refuses_runs_of_other_splits_or_users(runs, tmp_path, capsys) -> None:
    assert cli.main(["eval", "summarize", str(runs["a"]), str(runs["valid"])]) == 2
    assert "split is 'valid'" in capsys.readouterr().err
    other = _read(runs["seed1"])
    other["per_user"]["users"]["all"] = other["per_user"]["users"]["all"][:-1]
    edited = tmp_path / "fewer.json"
    edited.write_text(json.dumps(other))
    assert cli.main(["eval", "summarize", str(runs["a"]), str(edited)]) == 2
    assert "other users" in capsys.readouterr().err
    older = {k: v for k, v in _read(runs["a"]).items() if k != "per_user"}
    edited.write_text(json.dumps(older))
    assert cli.main(["eval", "summarize", str(runs["a"]), str(edited)]) == 2
    assert "per_user" in capsys.readouterr().err
    assert cli.main(["eval", "summarize", str(runs["a"])]) == 2
    assert "2 or more" in capsys.readouterr().err


def test_report_draws_the_comparison(runs, tmp_path) -> None:
    out = tmp_path / "img"
    assert cli.main(["report", "--out", str(out), "--formats", "svg", "--label", "tiny synthetic",
                     str(runs["a"])]) == 0
    svg = (out / "a_against.svg").read_text(encoding="utf-8")
    for text in ("one bundle against another", "B: copy", "Recall@K: A / B", "NDCG@K: A / B", "parity (1.0x)",
                 "all (", "warm (", "K = 10"):
        assert text in svg, text
    assert (out / "a_quality.svg").is_file()  # the evaluation's own figures as before
