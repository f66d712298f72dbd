"""``recsvc bench reproduce``: the recipe's stages under a past commit's code and this tree's. The committed HEAD
against this tree, with the same lines (``--no-restore``), reproduces the tiny recipe's target to the last leaf;
the comparison leaves out timings and paths and lists one-sided keys apart; RESTORE reaches only the new side."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_commands import only_commands
from test_train_fixtures import make_data, one_thread  # noqa: F401 (one_thread: a fixture)

import recsvc.cli.main as cli
from bench import reproduce

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(reproduce.__file__).resolve().parents[1]
TINY_TARGET = ["target.preset=tiny", "target.epochs=1", "target.max_minutes=none", "target.fit_budget=false",
               "target.recall_users=20", "target.eval_users=20"]


def test_restore_reaches_only_the_new_side() -> None:
    sides = reproduce.side_stages(["trials=3"], "target", "mix", threads=1)
    old, new = ({s.name: s for s in sides[k]} for k in ("old", "new"))
    assert list(old) == ["target", "prior", "prior-excl", "mix"] and list(new) == list(old)
    assert old["target"].optimizer is None and new["target"].optimizer == "foreach"
    assert not old["prior"].full_decode and new["prior"].full_decode and new["mix"].full_decode
    assert {s.trials for s in (*sides["old"][1:], *sides["new"][1:])} == {3}
    assert all(s.threads == 1 for s in (*sides["old"], *sides["new"]))
    line = " ".join(new["prior"].commands(reproduce_paths())[0].argv)
    assert line.endswith("--full-decode") and "--optimizer foreach" in " ".join(
        new["target"].commands(reproduce_paths())[0].argv)
    plain = reproduce.side_stages([], "target", "target", threads=1, restore=False)
    assert plain["new"] == plain["old"]


def reproduce_paths():
    from training.recipe.stages import RecipePaths

    return RecipePaths(data=Path("d"), bundle=Path("b"), ids=Path("i/semantic_ids.json"))


def test_compare_leaves_out_timings_and_paths() -> None:
    old = {"history": [{"epoch": 1, "recall@10": 0.1, "seconds": 3.0}], "out": "/x/old/bundle/target",
           "tuning": {"prior": {"settings": {"w": 1.0}, "seconds_per_trial": 2}}}
    new = {"history": [{"epoch": 1, "recall@10": 0.1, "seconds": 9.0}], "out": "/x/new/bundle/target",
           "tuning": {"prior": {"settings": {"w": 1.5}, "check": {"users": 4}}}}
    c = reproduce.compare(old, new, "/x/old/bundle", "/x/new/bundle")
    assert c["differ"] == {"tuning.prior.settings.w": [1.0, 1.5]}
    assert c["equal"] == 3 and c["new_only"] == ["tuning.prior.check.users"] and c["old_only"] == []


@pytest.mark.skipif(shutil.which("git") is None or subprocess.run(
    ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0,
    reason="needs recsvc as a git clone")
def test_head_against_this_tree_reproduces_the_tiny_target(tmp_path, capsys, monkeypatch) -> None:
    only_commands(monkeypatch, "build", "train", "tokenizer", "bench")
    data = make_data(tmp_path, n_users=60)
    ids = tmp_path / "ids" / "semantic_ids.json"
    assert cli.main(["--progress", "off", "build", "--recipe", "served", "--data", str(data), "--out",
                     str(tmp_path / "ids-bundle"), "--ids", str(ids), "--to", "ids", "--set", "threads=1",
                     "sasrec_max_minutes=0.1", "ids.rqvae_epochs=3", f"cache_dir={tmp_path / 'cache'}"]) == 0
    out, report = tmp_path / "repro", tmp_path / "compare.json"
    argv = ["--progress", "off", "bench", "reproduce", "--against", "HEAD", "--no-restore", "--data", str(data),
            "--ids", str(ids), "--out", str(out), "--to", "target", "--set", *TINY_TARGET, "--json", str(report)]
    assert cli.main(argv) == 0
    result = json.loads(report.read_text())
    assert result["stages"] == ["target"] and result["restore"] == []
    assert result["code"] == {"old": str(out / "src"), "new": str(ROOT)}  # HEAD exported and run from there
    [epoch] = result["epochs"]
    assert epoch["old_recall@10"] is not None and epoch["old_recall@10"] == epoch["new_recall@10"]
    training = result["records"]["target/training.json"]
    assert training["equal"] > 20 and training["differ"] == {} and result["identical"]
    assert result["weights"]["target/model.safetensors"] == "identical"
    assert "reproduced: every shared leaf equal" in capsys.readouterr().out
    # a re-run keeps the finished stage on both sides
    assert cli.main(argv) == 0
    assert "target: done on both sides, kept" in capsys.readouterr().out
