"""The notebook API, the `recsvc train teacher|drafter` commands and `recsvc bench drafters`, end to end on a
tiny bundle."""

from __future__ import annotations

import json

import pytest
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from recsvc.data.split import load_split_dir
from training.drafters.api import build_teacher, evaluate_acceptance, load_bundle, train_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    only_commands(monkeypatch, "train", "bench")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    b = load_bundle(tiny_bundle(tmp_path_factory.mktemp("api")))
    meta = build_teacher(b, k=3, max_prefixes=80, batch_size=16, progress=False)
    assert meta["complete"] and meta["num_prefixes"] == 80
    return b


def test_api_train_and_evaluate(bundle) -> None:
    info = train_drafter(bundle, method="seqkd", alpha=0.5, preset="drafter-tiny", epochs=1, batch_size=16,
                         bf16="off", out_name="seqkd", as_users=4, as_k=3, eval_max_users=10)
    assert info["method"] == "seqkd" and info["best"]["metric"] == "as@3" and "main_process" not in info
    res = evaluate_acceptance(bundle, split="test", k=3, n=4, gamma=2, users=4, drafter="seqkd")
    assert (res["k"], res["n"], res["gamma"], res["users"]) == (3, 4, 2, 4)
    strict, relaxed = res["strict"], res["relaxed"]
    assert strict["identical"] == 1.0  # strict verification is lossless whatever the drafter
    for r in (strict, relaxed):
        assert 0.0 <= r["AS"] <= 4.0 and 1.0 <= r["target_calls"] <= 4.0 and r["WS"] > 0 and r["plain_calls"] == 4
    users = [u.user_id for u in load_split_dir(bundle.data_dir()).eval_users("valid")[:2]]
    only = evaluate_acceptance(bundle, split="valid", k=2, users=users, modes=("strict",))
    assert only["users"] == 2 and "relaxed" not in only  # the served BUNDLE/drafter


def test_commands_and_bench(bundle, tmp_path, capsys) -> None:
    root = str(bundle.root)
    assert cli.main(["train", "teacher", "--bundle", root, "--k", "3", "--max-prefixes", "80", "--batch-size",
                     "16", "--threads", "1"]) == 0  # same configuration: every shard is skipped
    assert json.loads(capsys.readouterr().out)["complete"]
    assert cli.main(["train", "teacher", "--bundle", root, "--k", "5"]) == 2
    assert "--force" in capsys.readouterr().err
    argv = ["train", "drafter", "--bundle", root, "--preset", "drafter-tiny", "--method", "atspeed-r", "--epochs",
            "1", "--batch-size", "16", "--bf16", "off", "--as-users", "3", "--as-k", "2", "--eval-users", "10",
            "--out-name", "atspeed-r"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("\n{") :])["best"]["metric"] == "as_relaxed@2"  # auto: relaxed
    assert (bundle.root / "drafters" / "atspeed-r" / "config.json").is_file()
    assert cli.main([*argv[:-1], "atspeed-r-strict", "--verify", "strict", "--support", "trie"]) == 0
    printed = capsys.readouterr().out
    info = json.loads(printed[printed.index("\n{") :])
    assert info["best"]["metric"] == "as@2" and info["support"] == "trie"
    saved = json.loads((bundle.root / "drafters" / "atspeed-r-strict" / "training.json").read_text())
    assert saved["support"] == "trie"
    assert cli.main([*argv[:7], "seqkd", *argv[8:-1], "seqkd-trie", "--support", "trie"]) == 2
    assert "atspeed-r only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        cli.main([*argv, "--verify", "lenient"])
    assert bad.value.code == 2 and "--verify" in capsys.readouterr().err

    out = tmp_path / "bench.json"
    assert cli.main(["bench", "drafters", "--bundle", root, "--methods", "atspeed-r,retrieval", "--k", "1,5",
                     "--users", "3", "--modes", "both", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "### Strict top-K verification" in printed and "### Relaxed sampling verification" in printed
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    strict = {(r["drafter"], r["k"]) for r in rows if r["mode"] == "strict"}
    relaxed = {(r["drafter"], r["k"]) for r in rows if r["mode"] == "relaxed"}
    assert strict == {(d, k) for d in ("target", "atspeed-r", "retrieval") for k in (1, 5)}
    assert relaxed == {(d, k) for d in ("target", "atspeed-r") for k in (1, 5)}  # retrieval cannot sample
    rel5 = next(r for r in rows if r["mode"] == "relaxed" and r["drafter"] == "atspeed-r" and r["k"] == 5)
    assert {"WS", "AS", "AS_se", "target_calls", "recall@5", "ndcg@5"} <= set(rel5)
    assert len(payload["user_ids"]) == 3 and len(rel5["accepted"]) == 3
    assert rel5["AS"] == pytest.approx(sum(rel5["accepted"]) / 3)
    summary = tmp_path / "seeds.json"  # the seeds summary reads this file: one method, seed 0
    assert cli.main(["bench", "seeds", "--json", str(out), "--k", "5", "--reference", "atspeed-r",
                     "--out", str(summary)]) == 0
    assert "atspeed-r" in capsys.readouterr().out
    assert json.loads(summary.read_text())["methods"][0]["AS_mean"] == pytest.approx(rel5["AS"])
    assert all(r["identical"] == 1.0 for r in rows if r["mode"] == "strict" and r["drafter"] != "target")
    assert all(r["differing"] == [] for r in rows if r["mode"] == "strict" and r["drafter"] != "target")
    assert all(r["N"] == r["k"] for r in rows)  # default: N = K

    assert cli.main(["bench", "drafters", "--bundle", root, "--methods", "atspeed-r", "--k", "1,5", "--users", "2",
                     "--draft-beams", "4", "--modes", "strict", "--json", str(out)]) == 0
    capsys.readouterr()
    fixed = json.loads(out.read_text())
    assert fixed["draft_beams"] == 4 and {r["k"]: r["N"] for r in fixed["rows"]} == {1: 4, 5: 5}  # max(K, N)
    assert all(r["identical"] == 1.0 for r in fixed["rows"] if r["drafter"] != "target")
    assert cli.main(["bench", "drafters", "--bundle", root, "--methods", "atspeed-r", "--draft-beams", "0"]) == 2
    assert "--draft-beams" in capsys.readouterr().err

    assert cli.main(["bench", "drafters", "--bundle", root, "--methods", "wordkd", "--users", "2"]) == 2
    assert "--out-name wordkd" in capsys.readouterr().err
