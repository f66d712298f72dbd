"""`recsvc bench speculative` on a tiny bundle with a fused prior: the transition drafter stays exact, the phase
ledger accounts for every request's time, and the prior is recorded."""

from __future__ import annotations

import json

import pytest
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    only_commands(monkeypatch, "prior", "bench")


def test_transition_drafter_bench_with_phases(tmp_path) -> None:
    root = make_tiny_bundle(tmp_path, n_users=60)
    assert cli.main(["prior", "fit", "--bundle", str(root), "--weight", "1.0"]) == 0
    out = tmp_path / "spec.json"
    assert cli.main(["bench", "speculative", "--bundle", str(root), "--users", "5", "--k", "3", "--drafter",
                     "transition", "--grid", "K:3", "--dtype", "fp32", "--split", "valid", "--calibration-users", "2",
                     "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prior"]["weight"] == 1.0 and res["prior"]["fitted_on"] == "train"
    for row in res["rows"]:
        assert row["identical"] == 1.0  # strict speculation == plain beam search, both fused
        assert row["draft_calls"] == 0  # the transition drafter runs no network
        if row["N"] > 0:
            assert {"draft", "verify", "replay", "commit", "other"} <= set(row["phases_spec_ms"])
        assert {"forward", "head", "select", "other"} <= set(row["phases_plain_ms"])
        for name, total in (("plain", row["plain_ms"]), ("spec", row["spec_ms"])):
            assert abs(sum(row[f"phases_{name}_ms"].values()) - total) < 1e-6 * max(1.0, total)
    with pytest.raises(SystemExit) as exc:  # argparse rejects a bad choice with exit code 2
        cli.main(["bench", "speculative", "--bundle", str(root), "--prior", "maybe"])
    assert exc.value.code == 2


def test_a_named_llama_drafter(tmp_path) -> None:
    """--drafter-name picks a trained drafter under BUNDLE/drafters/ (a bundle may serve another one, or none)."""
    import shutil

    from recsvc.bundle.directory import Bundle

    root = make_tiny_bundle(tmp_path, n_users=40)
    bundle = Bundle.open(root)
    shutil.move(bundle.drafter_dir, root / "drafters" / "sft")
    base = ["bench", "speculative", "--bundle", str(root), "--users", "3", "--k", "3", "--drafter", "llama",
            "--grid", "K:3", "--dtype", "fp32", "--split", "valid", "--calibration-users", "2"]
    assert cli.main(base) == 2  # no BUNDLE/drafter: a clear error, exit 2
    out = tmp_path / "spec.json"
    assert cli.main(base + ["--drafter-name", "sft", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(row["identical"] == 1.0 for row in rows)
    assert any(row["draft_calls"] > 0 for row in rows)  # the named LLaMA drafter ran


def test_counts_per_request_over_the_bucketed_forward(tmp_path) -> None:
    """--forward bucketed (the CUDA graphs' path, uncaptured): every row reports plain's and speculation's eager
    device ops, graph replays and host reads per request; strict with the LLaMA drafter stays plain's lists in a
    handful of replays (L rounds of three units) and one read."""
    root = make_tiny_bundle(tmp_path, n_users=40)
    out = tmp_path / "spec.json"
    assert cli.main(["bench", "speculative", "--bundle", str(root), "--users", "3", "--k", "5", "--drafter", "llama",
                     "--grid", "K:3", "--dtype", "fp32", "--split", "valid", "--calibration-users", "2",
                     "--forward", "bucketed", "--count-users", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    spec = [row for row in rows if row["N"] > 0]
    assert spec and all(row["identical"] == 1.0 for row in rows)
    for row in spec:
        plain, strict = row["per_request_plain"], row["per_request_spec"]
        assert plain["requests"] == strict["requests"] == 2 and plain["replays"] == 8 and plain["host_reads"] == 0
        assert strict["eager_ops"] <= 2 * plain["eager_ops"] and strict["replays"] <= plain["replays"] + 4
        assert strict["host_reads"] <= 2
