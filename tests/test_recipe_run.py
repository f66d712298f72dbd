"""``recsvc build --recipe served`` end to end on tiny synthetic data: every stage of the served recipe (the ids'
SASRec and RQ-VAE, the target, the tunings, the draft head) through ``--to`` / ``--from``, an interrupted stage that
a re-run resumes from, and a finished recipe that a re-run skips stage by stage."""

from __future__ import annotations

import pytest
from cli_commands import only_commands
from test_train_fixtures import make_data, one_thread  # noqa: F401 (one_thread: a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from training.recipe.recipes import SERVED

pytestmark = pytest.mark.usefixtures("one_thread")

# the served recipe at the tiny scale: one thread, a tiny target for one epoch, two trials per search, 20 users
TINY = ["threads=1", "sasrec_max_minutes=0.1", "ids.rqvae_epochs=3", "target.preset=tiny", "target.epochs=1",
        "target.max_minutes=none", "target.fit_budget=false", "target.recall_users=20", "target.eval_users=20",
        "trials=2", "budget_minutes=1", "users=20", "dtype=fp32", "head.prefixes=40", "head.epochs=1"]


def test_the_served_recipe_runs_in_ranges_resumes_and_skips_what_is_done(tmp_path, capsys, monkeypatch) -> None:
    only_commands(monkeypatch, "build", "train", "tokenizer", "tune")
    data = make_data(tmp_path, n_users=80)
    bundle = tmp_path / "bundle"
    ids = tmp_path / "ids" / "semantic_ids.json"

    def build(*extra: str) -> int:
        return cli.main(["--progress", "off", "build", "--recipe", "served", "--data", str(data), "--out",
                         str(bundle), "--ids", str(ids), "--set", *TINY, f"cache_dir={tmp_path / 'cache'}", *extra])

    def records() -> dict:
        return Bundle.open(bundle).read().get("recipe", {})

    # the ids and the target only
    assert build("--to", "target") == 0
    assert set(records()) == {"ids", "target"} and ids.is_file() and (tmp_path / "ids-sasrec").is_dir()
    assert Bundle.open(bundle).is_done("target") and (bundle / "target" / "dense_head.safetensors").is_file()
    out = capsys.readouterr().out
    assert "[served 1/2] ids: running (2 commands)" in out and "$ recsvc tokenizer build" in out

    # a stage that fails (a search with no trials is refused) stops the recipe there, unrecorded
    assert build("--from", "prior", "--set", "prior.trials=0") == 2
    assert set(records()) == {"ids", "target"}
    assert "--trials" in capsys.readouterr().err

    # the re-run skips what is done and runs the rest
    assert build() == 0
    assert set(records()) == {s.name for s in SERVED}
    out = capsys.readouterr().out
    assert "[served 1/10] ids: done earlier" in out and "[served 2/10] target: done earlier" in out
    assert "$ recsvc build" not in out and "$ recsvc tune prior" in out and "$ recsvc train head" in out
    meta = Bundle.open(bundle).read()
    assert {"prior", "mix", "history"} <= set(meta["tuning"]) and (bundle / "head" / "config.json").is_file()
    assert records()["mix-excl"]["commands"][0].endswith("--exclude-history --dtype fp32")

    # finished: nothing runs again; a changed parameter re-runs only its stage (shown by --dry-run)
    assert build() == 0
    out = capsys.readouterr().out
    assert "$ recsvc" not in out and out.count("done earlier") == len(SERVED)
    assert build("--set", "head.epochs=2", "--dry-run") == 0
    out = capsys.readouterr().out
    assert out.count("to run") == 1 and "[served 10/10] head: to run" in out
    ids_record = records()["ids"]
    assert ids_record["done"] and ids_record["seconds"] > 0 and len(ids_record["commands"]) == 2
