"""``recsvc bench serve``: a short in-process run, the JSON report, and the Redis outage drill."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from bench import serve as bench
from recsvc.errors import UserError


def test_bench_rows_json_and_table(catalog, tmp_path, capsys):
    out = tmp_path / "serve.json"
    report = bench.run_serve_bench(catalog, [3], 0.4, None, None, None, out, users=8, history_len=5)
    assert json.loads(out.read_text()) == report
    rows = report["rows"]
    configs = [(r["max_batch"], r["mode"]) for r in rows]
    assert configs == [(16, "strict"), (16, "plain"), (1, "strict"), (1, "plain")]
    for row in rows:
        assert row["ok"] > 0 and row["errors"] == {} and row["throughput_rps"] > 0
        assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
    assert all(r["mean_batch_size"] == 1.0 for r in rows if r["max_batch"] == 1)
    table = capsys.readouterr().out
    assert table.startswith("| config | conc. | req/s |") and "batch16/strict" in table


def test_bench_against_running_target(catalog, make_server):
    server = make_server(catalog)
    report = bench.run_serve_bench(server.address, [2], 0.3, speculation=False, users=4, print_table=False)
    (row,) = report["rows"]
    assert row["config"] == "server/plain" and row["ok"] > 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_bench_outage_drill(catalog):
    report = bench.run_serve_bench(
        catalog, [3], 0.9, "spawn", True, True, None, users=4, history_len=3, outage=True, print_table=False
    )
    outage = report["outage"]
    assert outage["verified"] and outage["acknowledged_records"] > 0
    assert outage["write_during_outage"] == "UNAVAILABLE"  # refused, not acknowledged and lost
    assert sum(outage["phases"]["during"].values()) > 0
    assert outage["phases"]["before"].get("OK", 0) > 0 and outage["phases"]["after"].get("OK", 0) > 0
    assert set(outage["phases"]["during"]) <= {"OK", "UNAVAILABLE"}


def test_bench_argument_errors(catalog):
    with pytest.raises(UserError, match="spawn"):
        bench.run_serve_bench(catalog, [1], 0.1, "redis://127.0.0.1:1/0", outage=True)
    with pytest.raises(UserError, match="in-process"):
        bench.run_serve_bench("127.0.0.1:1", [1], 0.1, "spawn", outage=True)
    parser = argparse.ArgumentParser()
    bench.add_args(parser)  # as `recsvc bench serve` adds them (bench/cli.py)
    args = parser.parse_args(["--target", "h:1", "--concurrency", "1,8", "--batching", "off"])
    assert args.concurrency == [1, 8] and args.batching == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "h:1", "--concurrency", "0"])


def test_fuzz_bench_with_deadlines_cancellations_and_extreme_temperatures(catalog, make_server):
    from bench import fuzz

    server = make_server(catalog, max_wait_ms=1.0)
    args = argparse.Namespace(bundle=None, target=server.address, requests=300, concurrency=3, seed=1,
                              dtype="fp32", hostile_share=0.3, json_path=None)
    payload = fuzz.run(args)
    assert payload["internal_or_unknown"] == 0 and payload["serving_after"], payload
    assert payload["codes"].get("INVALID_ARGUMENT", 0) > 0
    assert set(payload["codes"]) & {"CANCELLED", "DEADLINE_EXCEEDED"}, payload["codes"]
    for code in ("INTERNAL", "UNKNOWN"):
        assert not server.metrics.registry.get_sample_value(
            "recsvc_errors_total", {"method": "Recommend", "code": code}
        ), code
