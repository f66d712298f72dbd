"""`recsvc build` and `recsvc train target` end to end on a small synthetic data set (tiny preset)."""

from __future__ import annotations

import json

import pytest
from cli_commands import only_commands
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401 (one_thread: a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.bundle.prompt import PromptBuilder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    """The real entry point, limited to the groups under test (others may be mid-edit)."""
    only_commands(monkeypatch, "train", "build")


def main(argv: list[str]) -> int:
    return cli.main(argv)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    d = make_data(root, n_users=40)
    return d, write_ids(d, root / "ids.json")


def test_build_then_skip_then_train_errors(data, tmp_path, capsys) -> None:
    d, ids = data
    out = tmp_path / "bundle"
    argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny",
            "--epochs", "1", "--batch-size", "8", "--eval-users", "10", "--bf16", "off"]
    assert main(argv) == 0
    b = Bundle.open(out)
    assert all(b.is_done(s) for s in ("ids", "tokenizer", "target"))
    meta = b.read()
    assert meta["target_preset"] == "tiny" and meta["stages"]["target"]["best"]["metric"] == "recall@10"
    model = b.load_target(dtype="fp32")
    tok = b.load_tokenizer()
    assert model.config.vocab_size == len(tok)
    builder = PromptBuilder(tok, b.load_ids())
    assert len(builder.prompt_ids([1, 2, 3])) < 60
    history = json.loads((b.target_dir / "training.json").read_text())["history"]
    assert len(history) == 1 and "valid_loss" in history[0]

    capsys.readouterr()
    assert main(argv) == 0  # everything done: skipped
    assert capsys.readouterr().out.count("done earlier, skipped") == 3

    # a checkpoint exists: train needs --resume or --force
    assert main(["train", "target", "--data", str(d), "--bundle", str(out), "--preset", "tiny"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_user_errors(data, tmp_path, capsys) -> None:
    d, ids = data
    assert main(["train", "target", "--data", str(tmp_path / "nope"), "--bundle", str(tmp_path)]) == 2
    assert "data directory not found" in capsys.readouterr().err
    assert main(["train", "target", "--data", str(d), "--bundle", str(tmp_path / "b"), "--lora"]) == 2
    assert "--lora needs --base-model" in capsys.readouterr().err
    assert main(["train", "target", "--data", str(d), "--bundle", str(tmp_path / "c"), "--preset", "tiny"]) == 2
    assert "no semantic ids" in capsys.readouterr().err
    assert main(["build", "--data", str(d), "--out", str(tmp_path / "d"), "--stages", "ids,rocket"]) == 2
    assert "unknown stage" in capsys.readouterr().err


def test_build_deploy_protocol_compact_prompt(data, tmp_path) -> None:
    """--protocol deploy keeps the train-only model and refits on train + valid; the compact header is recorded
    and every reader of the bundle rebuilds the same prompts."""
    d, ids = data
    out = tmp_path / "deploy"
    argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny", "--epochs", "1",
            "--batch-size", "8", "--eval-users", "10", "--bf16", "off", "--protocol", "deploy", "--prompt", "compact"]
    assert main(argv) == 0
    b = Bundle.open(out)
    meta = b.read()
    assert meta["protocol"] == "deploy" and meta["prompt"] == {"header": "compact", "max_history": 20}
    info = json.loads((b.target_dir / "training.json").read_text())
    assert info["protocol"] == "deploy" and info["refit"]["epochs"] == 1
    assert info["refit"]["tokens_per_epoch"] > info["tokens_per_epoch"]  # the valid items are trained on too
    assert (b.train_only_target_dir / "config.json").is_file()
    builder = b.prompt_builder()
    assert builder.header == "compact" and builder.prompt_ids([]) == [b.load_tokenizer().bos_token_id]
    # the refit changed the weights: the served target is not the train-only one
    import torch

    from recsvc.bundle.loading import load_causal_lm

    served = b.load_target(dtype="fp32")
    train_only = load_causal_lm(b.train_only_target_dir, dtype="fp32")
    assert not torch.equal(served.lm_head.weight, train_only.lm_head.weight)
    # one deploy bundle gives both protocols' figures: paper = the train-only target
    from training.evaluation.evaluate import evaluate_bundle

    paper = evaluate_bundle(out, "test", (5,), dtype="fp32", protocol="paper", baselines=("transition",))
    deploy = evaluate_bundle(out, "test", (5,), dtype="fp32", baselines=("transition",))
    assert (paper["target"], deploy["target"]) == ("target-train", "target")
    assert (paper["protocol"], deploy["protocol"]) == ("paper", "deploy")
    # the paired lead over each baseline restates the table's means and brackets their ratio
    lead = deploy["lead"]["transition"]["recall@5"]
    assert lead["model"] == deploy["model"]["recall@5"]
    assert lead["baseline"] == deploy["baselines"]["transition"]["recall@5"]
    if lead["ratio"] is not None:
        assert lead["ratio_lo"] <= lead["ratio"] <= lead["ratio_hi"]


def test_bad_target_settings_exit_2(data, tmp_path, capsys) -> None:
    d, ids = data
    base = ["build", "--data", str(d), "--out", str(tmp_path / "b"), "--ids", str(ids), "--preset", "tiny"]
    assert main(base + ["--refit-epochs", "0"]) == 2
    assert "--refit-epochs" in capsys.readouterr().err
    for bad, flag in ((["--recall-users", "0"], "--recall-users"), (["--eval-users", "some"], "--eval-users"),
                      (["--select", "coin"], "--select")):
        with pytest.raises(SystemExit) as stop:  # argparse's usage error: exit 2 with a message
            main(base + bad)
        assert stop.value.code == 2 and flag in capsys.readouterr().err
    assert main(base + ["--max-history", "0"]) == 2
    assert "--max-history" in capsys.readouterr().err


def test_deploy_scratch_refit_without_selection(data, tmp_path) -> None:
    """--refit scratch --epochs 0: no selection phase, a fresh model trained on train + valid for --refit-epochs."""
    d, ids = data
    out = tmp_path / "scratch"
    argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny", "--epochs", "0",
            "--batch-size", "8", "--eval-users", "10", "--bf16", "off", "--protocol", "deploy", "--refit", "scratch",
            "--refit-epochs", "2"]
    assert main(argv) == 0
    info = json.loads((Bundle.open(out).target_dir / "training.json").read_text())
    assert info["refit"]["mode"] == "scratch" and info["refit"]["epochs"] == 2 and info["epochs"] == 0
    assert not Bundle.open(out).train_only_target_dir.exists()  # nothing was trained on train alone
    refused = [a for a in argv if a not in ("--refit", "scratch")]
    assert main([*refused[:4], str(tmp_path / "other"), *refused[5:]]) == 2  # --epochs 0 needs --refit scratch


def test_deploy_scratch_refit_auto_takes_the_chosen_epoch_count(data, tmp_path) -> None:
    """--refit scratch --refit-epochs auto: a fresh model trained on train + valid for the epoch count the
    selection phase chose on valid (the classic refit), under the selection run's schedule (sized for its planned
    epochs, stopped after the chosen one); the record carries each epoch's mean and standard error over every
    validation user and the paired difference to the best epoch."""
    d, ids = data
    out = tmp_path / "auto"
    argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny", "--epochs", "3",
            "--batch-size", "8", "--eval-users", "10", "--bf16", "off", "--protocol", "deploy", "--refit", "scratch",
            "--refit-epochs", "auto", "--patience", "0"]
    assert main(argv) == 0
    info = json.loads((Bundle.open(out).target_dir / "training.json").read_text())
    assert info["best_epoch"] >= 1 and info["refit"]["epochs"] == info["best_epoch"]
    assert info["select"] == "within-se" and info["refit"]["schedule_epochs"] == info["schedule_epochs"] == 3
    rows = info["selection"]
    assert [r["epoch"] for r in rows] == [1.0, 2.0, 3.0] and sum(r["chosen"] for r in rows) == 1
    chosen = next(r for r in rows if r["chosen"])
    assert chosen["epoch"] == info["best_epoch"]
    assert -chosen["vs_best"] <= chosen["vs_best_se"]  # within one paired error of the best (or the best)
    # no later epoch within noise of the best was passed over
    assert all(-r["vs_best"] > r["vs_best_se"] for r in rows if r["epoch"] > chosen["epoch"])
    for r, h in zip(rows, info["history"], strict=True):  # the epoch log's numbers are the record's
        assert h["recall@10"] == pytest.approx(r["mean"]) and h["selection"]["se"] == pytest.approx(r["se"])
        assert r["se"] is not None
    # every validation user by default (the synthetic set's users with a valid item)
    from recsvc.data.split import load_split_dir

    assert info["history"][0]["users"] == len([u for u in load_split_dir(d).eval_users("valid") if u.targets])
    # the refit's learning rates follow the selection run's schedule (its own steps per epoch: train + valid)
    for e in range(info["refit"]["epochs"]):
        assert info["refit"]["lr_by_epoch"][e] == pytest.approx(info["lr_by_epoch"][e], rel=0.15, abs=1e-9)
    assert Bundle.open(out).train_only_target_dir.is_dir()
    assert main([*argv[:4], str(tmp_path / "bad"), *argv[5:-4], "--refit-epochs", "many"]) == 2


def test_build_plan_counts_an_epoch_and_times_real_steps(data, tmp_path, capsys) -> None:
    """--plan trains nothing: it reports tokens per epoch, the labelled share and measured tokens/s; the packed
    prompt (no separator) has fewer tokens per epoch than the compact one for the same labels."""
    d, ids = data
    plans = {}
    for prompt in ("compact", "packed"):
        out = tmp_path / prompt
        argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids), "--preset", "tiny",
                "--batch-size", "8", "--bf16", "off", "--protocol", "deploy", "--prompt", prompt, "--plan",
                "--plan-steps", "3", "--max-minutes", "30", "--epochs", "4"]
        assert main(argv) == 0
        printed = capsys.readouterr().out
        assert "tokens per epoch" in printed and "epochs fit" in printed and "--fit-budget: a 4-epoch" in printed
        plans[prompt] = json.loads((out / "plan.json").read_text())
        assert not Bundle.open(out).is_done("target") and not (out / "target").exists()
    c, p = plans["compact"], plans["packed"]
    assert p["train_tokens_per_s"] > 0 and p["epochs_in_budget"] > 0
    assert p["fit_budget"]["epochs"] == 4 and p["fit_budget"]["eval_seconds"] > 0  # what --fit-budget would run
    assert p["selection"]["labelled_tokens_per_epoch"] == c["selection"]["labelled_tokens_per_epoch"]
    assert p["selection"]["tokens_per_epoch"] < c["selection"]["tokens_per_epoch"]
    assert p["selection"]["labelled_share"] > c["selection"]["labelled_share"]
    assert p["refit"]["tokens_per_epoch"] > p["selection"]["tokens_per_epoch"]  # train + valid
    assert main(["build", "--data", str(d), "--out", str(tmp_path / "x"), "--ids", str(ids), "--plan",
                 "--plan-steps", "0"]) == 2
    assert "--plan-steps" in capsys.readouterr().err


def test_build_fit_budget_records_its_plan(data, tmp_path, capsys) -> None:
    """--fit-budget times the epoch before training and runs the schedule over the epochs that fit (here the
    budget is ample, so --epochs caps it); the plan is recorded in training.json; no budget -> exit 2."""
    d, ids = data
    argv = ["build", "--data", str(d), "--out", str(tmp_path / "fit"), "--ids", str(ids), "--preset", "tiny",
            "--epochs", "2", "--batch-size", "8", "--eval-users", "10", "--recall-users", "5", "--bf16", "off",
            "--patience", "0", "--fit-budget", "--max-minutes", "30"]
    assert main(argv) == 0
    assert "--fit-budget: 2 epoch(s) in 30 min" in capsys.readouterr().out
    info = json.loads((Bundle.open(tmp_path / "fit").target_dir / "training.json").read_text())
    plan = info["budget_plan"]
    assert info["schedule_epochs"] == plan["epochs"] == info["epochs"] == 2 and plan["epochs_fit"] > 2
    assert plan["train_tokens_per_s"] > 0 and plan["eval_seconds"] > 0 and plan["budget_minutes"] == 30
    assert main([*argv[:4], str(tmp_path / "nobudget"), *argv[5:-2]]) == 2
    assert "--max-minutes" in capsys.readouterr().err


def test_patience_is_off_under_fit_budget_unless_given(data, tmp_path, capsys) -> None:
    """A budget-sized schedule anneals only at its end, so by default it runs whole (the best epoch is kept);
    without --fit-budget the default stays 2; a given value always wins; a negative one is exit 2."""
    from training.target_lm.budget import default_patience

    assert (default_patience(None, False), default_patience(None, True)) == (2, 0)
    assert (default_patience(3, True), default_patience(0, False)) == (3, 0)
    d, ids = data
    argv = ["build", "--data", str(d), "--out", str(tmp_path / "neg"), "--ids", str(ids), "--preset", "tiny",
            "--epochs", "1", "--patience", "-1"]
    assert main(argv) == 2
    assert "--patience" in capsys.readouterr().err
