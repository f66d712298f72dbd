"""`recsvc bench cache` and `recsvc bench replay` on the tiny bundle (a few seconds each)."""

from __future__ import annotations

import json
import shutil

import pytest
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle

from recsvc.cli.main import main


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("bundle"), n_users=30)


def test_bench_cache_compares_the_paths_in_one_run_and_measures_the_linear_floor(bundle, tmp_path) -> None:
    out = tmp_path / "cache.json"
    assert main(["bench", "cache", "--bundle", str(bundle), "--users", "6", "--k", "3", "--beam-width", "5",
                 "--threads", "1", "--warmup", "1", "--sweep-users", "2", "--no-compiled", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["path"]: r for r in report["rows"]}
    # the compiled path is left out here (its compiles take a minute; tests/test_engine_compiled.py covers it)
    assert set(rows) == {"lean", "fast", "cached", "repeat"} and report["state_forward"] == "fast"
    assert rows["lean"]["forwards_per_request"] == 4
    # the fast path's bounded last step: at least the 4 forwards (a 5th when the bound needs a second part), and
    # never more tokens than the lean path, which feeds every beam
    assert rows["fast"]["forwards_per_request"] >= 4
    assert rows["fast"]["tokens_per_request"] <= rows["lean"]["tokens_per_request"]
    assert rows["cached"]["forwards_per_request"] == 3  # the prompt forward skipped
    assert rows["repeat"]["forwards_per_request"] == 0  # an identical request: every step replayed
    assert report["identical_cached_vs_uncached"] == report["identical_repeat_vs_uncached"] == 1.0
    assert report["identical_items_compiled_vs_lean"] is None
    assert report["drafter_fixed_ms_per_forward"] is not None  # the tiny bundle has a LLaMA drafter
    assert all(r["fixed_ms_per_forward"] == r["fixed_ms_per_forward"] for r in rows.values())  # fitted (not nan)
    # the linear floor: the target's packed linears alone at a request's row counts
    floors = ("floor_ms_per_forward", "weight_bytes", "weight_GBps", "floor_uncached_ms", "floor_cached_ms",
              "floor_uncached_vs_lean", "floor_cached_vs_lean")
    assert all(report[f] > 0 for f in floors) and report["floor_measured"]
    assert report["floor_decode_forwards"] == 3 and report["floor_beams"] == 5
    assert report["floor_uncached_ms"] > report["floor_cached_ms"]  # the prompt forward on top


def test_bench_cache_measures_the_llama_drafter_it_is_told_to(bundle, tmp_path, capsys) -> None:
    base = ["bench", "cache", "--bundle", str(bundle), "--users", "2", "--k", "3", "--beam-width", "5", "--threads",
            "1", "--warmup", "1", "--sweep-users", "1", "--no-compiled"]
    out = tmp_path / "none.json"
    assert main([*base, "--llama-drafter", "none", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["drafter_fixed_ms_per_forward"] is None
    out = tmp_path / "named.json"
    assert main([*base, "--llama-drafter", "drafter", "--json", str(out)]) == 0  # BUNDLE/drafter by name
    fixed = json.loads(out.read_text())["drafter_fixed_ms_per_forward"]
    assert set(fixed) == {"lean", "fast"} and all(v == v for v in fixed.values())  # fitted (not nan)
    capsys.readouterr()
    assert main([*base, "--llama-drafter", "no-such-drafter"]) == 2  # a clear error, no traceback
    assert "no drafter 'no-such-drafter'" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_bench_replay_against_a_served_bundle_and_redis(bundle, tmp_path) -> None:
    out = tmp_path / "replay.json"
    assert main(["bench", "replay", "--bundle", str(bundle), "--users", "5", "--r", "2", "--k", "3",
                 "--concurrency", "2", "--threads", "1", "--max-seconds", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_cache = {r["cache"]: r for r in report["rows"]}
    assert set(by_cache) == {"lean", "off", "on", "ahead"}
    assert all(r["recommend"] > 0 and r["record"] > 0 and not r["errors"] for r in report["rows"])
    assert by_cache["off"]["hit_rate"] == by_cache["lean"]["hit_rate"] == 0.0
    # the second of R = 2 calls before an interaction repeats the first one's prompt: a full hit
    assert by_cache["on"]["hit_rate"] > 0.3
    # ahead: the write's prefill runs before the next Recommend when the engine is idle: more full hits
    assert by_cache["ahead"]["hit_rate"] >= by_cache["on"]["hit_rate"]
    assert all(r["rss_mb"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in report["rows"])
