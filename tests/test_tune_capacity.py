"""`recsvc tune capacity`: presets trained by one recipe, compared on validation against the first (tiny sizes)."""

from __future__ import annotations

import json

import pytest
from cli_commands import only_commands
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401

import recsvc.cli.main as cli
from training.tuning.capacity import choose


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch, tmp_path_factory):
    only_commands(monkeypatch, "build", "tune", "eval")
    monkeypatch.setenv("RECSVC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "emb-cache"))


@pytest.mark.usefixtures("one_thread")
def test_capacity_trains_each_preset_and_compares_it_paired_on_validation(tmp_path) -> None:
    d = make_data(tmp_path / "data-root", n_users=40)
    ids = write_ids(d, tmp_path / "ids.json")
    out = tmp_path / "capacity"
    argv = ["tune", "capacity", "--data", str(d), "--ids", str(ids), "--out", str(out), "--presets", "tiny,small",
            "--epochs", "1", "--batch-size", "8", "--dense-head", "0.5", "--baselines", "popularity",
            "--threads", "1"]
    assert cli.main(argv) == 0
    report = json.loads((out / "capacity.json").read_text())
    assert report["presets"] == ["tiny", "small"] and report["reference"] == "tiny" and not report["skipped"]
    for preset in ("tiny", "small"):
        b = report["builds"][preset]
        assert b["epochs_run"] == 1 and b["best_epoch"] == 1 and b["params"] > 0
        training = json.loads((out / preset / "target" / "training.json").read_text())
        assert training["preset"] == preset and training["protocol"] == "paper"
    assert report["builds"]["small"]["params"] > report["builds"]["tiny"]["params"]
    # the later preset against the reference: the eval JSON's paired cells, the same users on both sides
    result = json.loads((out / "eval_small.json").read_text())
    assert result["split"] == "valid" and result["against"]["label"] == "tiny"
    cell = result["against"]["lead"]["all"]["ndcg@10"]
    assert report["against"]["small"]["ndcg@10"]["ratio"] == cell["ratio"]
    assert report["against"]["small"]["ndcg@10"]["model"] == pytest.approx(result["model"]["ndcg@10"])
    assert report["chosen"] == choose("tiny", report["against"])
    assert report["against"]["small"]["baselines"]["popularity"]["ndcg@10"] == result["baselines"]["popularity"][
        "ndcg@10"]
    # resumable: a second run trains nothing again and reports the same comparison
    stamp = (out / "small" / "target" / "training.json").stat().st_mtime_ns
    assert cli.main(argv) == 0
    assert (out / "small" / "target" / "training.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "capacity.json").read_text())["against"] == report["against"]


def test_capacity_refuses_a_single_preset_with_a_message(tmp_path, capsys) -> None:
    assert cli.main(["tune", "capacity", "--data", str(tmp_path), "--ids", str(tmp_path / "x.json"), "--out",
                     str(tmp_path / "o"), "--presets", "small"]) == 2
    assert "two or more distinct target presets" in capsys.readouterr().err


def test_a_preset_replaces_the_reference_only_above_noise() -> None:
    rows = {"base": {"ndcg@10": {"ratio": 1.08, "ratio_lo": 0.97}}, "medium": {"ndcg@10": None}}
    assert choose("small", rows) == "small"
    rows["base"]["ndcg@10"]["ratio_lo"] = 1.01
    assert choose("small", rows) == "base"
