"""`recsvc bench seeds`: per-seed AS, paired differences and their interval, checked by hand on tiny inputs."""

from __future__ import annotations

import json
import math

import pytest

import recsvc.cli.main as cli
from bench.seeds import split_seed, summarize, verdict
from recsvc.errors import UserError


def payload(accepted: dict[str, list[int]], users: list[int] | None = None, n: int = 10) -> dict:
    rows = [{"mode": "relaxed", "k": 10, "N": n, "gamma": 3, "drafter": "target"}]
    rows += [{"mode": "relaxed", "k": 10, "N": n, "gamma": 3, "drafter": name, "accepted": acc}
             for name, acc in accepted.items()]
    rows += [{"mode": "strict", "k": 10, "N": n, "gamma": 3, "drafter": name, "accepted": [0] * len(acc)}
             for name, acc in accepted.items()]
    return {"bench": "drafters", "user_ids": users or [7, 8, 9, 11], "split": "test", "temperature": 1.0,
            "dtype": "bf16", "rows": rows}


def test_split_seed():
    assert split_seed("atspeed-r-trie-a09-s2") == ("atspeed-r-trie-a09", 2)
    assert split_seed("atspeed-r-trie-a09") == ("atspeed-r-trie-a09", 0)
    assert split_seed("sft") == ("sft", 0)


def test_summary_by_hand():
    # reference r: seed 0 accepts [2, 1, 1, 0] (AS 1.0), seed 1 [2, 2, 1, 1] (AS 1.5); per user 2, 1.5, 1, 0.5
    # baseline b: one seed, [1, 1, 1, 1] (AS 1.0); differences r - b per user: 1, 0.5, 0, -0.5 (mean 0.25)
    a = payload({"r": [2, 1, 1, 0], "b": [1, 1, 1, 1]})
    b = payload({"r-s1": [2, 2, 1, 1]})
    s = summarize([a, b], "relaxed", 10, "r")
    assert s["users"] == 4 and [m["method"] for m in s["methods"]] == ["r", "b"]  # the reference first
    r, base = s["methods"]
    assert r["seeds"] == [0, 1] and r["AS_per_seed"] == {0: 1.0, 1: 1.5}
    assert r["AS_mean"] == 1.25 and (r["AS_min"], r["AS_max"]) == (1.0, 1.5)
    sd_r = math.sqrt(sum((x - 1.25) ** 2 for x in (2, 1.5, 1, 0.5)) / 3)
    assert r["AS_se_users"] == pytest.approx(sd_r / 2)
    assert "diff" not in r and verdict(r) == "reference"
    assert base["diff"] == pytest.approx(0.25)
    sd_d = math.sqrt(sum((x - 0.25) ** 2 for x in (1, 0.5, 0, -0.5)) / 3)
    assert base["diff_ci95"] == pytest.approx(1.96 * sd_d / 2)
    assert (base["pairs_won"], base["pairs"]) == (2, 2)  # 1.0 >= 1.0 and 1.5 >= 1.0
    assert verdict(base) == "ref >= (within noise)"  # 0.25 +- 0.60
    assert verdict({"diff": 0.3, "diff_ci95": 0.1}) == "ref > (significant)"
    assert verdict({"diff": -0.3, "diff_ci95": 0.1}) == "ref < (significant)"
    assert verdict({"diff": -0.05, "diff_ci95": 0.1}) == "ref < (within noise)"
    assert summarize([a], "strict", 10, "r")["methods"][1]["diff"] == 0.0  # the other mode's rows


def test_mismatched_inputs_are_refused():
    a = payload({"r": [2, 1, 1, 0]})
    with pytest.raises(UserError, match="other users"):
        summarize([a, payload({"b": [1, 1, 1, 1]}, users=[1, 2, 3, 4])], "relaxed", 10, "r")
    with pytest.raises(UserError, match="another setting"):
        summarize([a, payload({"b": [1, 1, 1, 1]}, n=20)], "relaxed", 10, "r")
    with pytest.raises(UserError, match="more than one input"):
        summarize([a, payload({"r": [1, 1, 1, 1]})], "relaxed", 10, "r")
    with pytest.raises(UserError, match="not among the methods"):
        summarize([a], "relaxed", 10, "wordkd")
    with pytest.raises(UserError, match="no relaxed rows at K=5"):
        summarize([a], "relaxed", 5, "r")
    old = payload({"r": [2, 1, 1, 0]})
    del old["user_ids"]
    with pytest.raises(UserError, match="per-user results"):
        summarize([old], "relaxed", 10, "r")


def test_cli(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(payload({"r": [2, 1, 1, 0], "b": [1, 1, 1, 1]})))
    b.write_text(json.dumps(payload({"r-s1": [2, 2, 1, 1]})))
    out = tmp_path / "s.json"
    assert cli.main(["bench", "seeds", "--json", f"{a},{b}", "--reference", "r", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| r | 0,1 | 1.000 / 1.500 | 1.250 |" in printed and "+0.250" in printed
    assert json.loads(out.read_text())["methods"][1]["pairs_won"] == 2
    assert cli.main(["bench", "seeds", "--json", str(tmp_path / "missing.json"), "--reference", "r"]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert cli.main(["bench", "seeds", "--json", str(a), "--reference", "wordkd"]) == 2
    assert "not among the methods" in capsys.readouterr().err
