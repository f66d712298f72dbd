"""``recsvc bench processes``: ``recsvc serve --processes N`` as a subprocess under load (a tiny bundle, short
runs, no timing assertions): the JSON report, both workers served, threads per worker, clean exit; bad flags."""

from __future__ import annotations

import json

import pytest
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle

from recsvc.cli.main import main


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("processes"), n_users=30)


def test_processes_1_and_2_end_to_end(bundle, tmp_path, capsys):
    out = tmp_path / "processes.json"
    argv = ["bench", "processes", "--bundle", str(bundle), "--processes", "1,2", "--concurrency", "6",
            "--duration", "2", "--warmup", "0.3", "--k", "5", "--spec", "off", "--users", "20",
            "--json", str(out)]
    try:
        assert main(argv) == 0
    except SystemExit as exc:
        pytest.fail(f"exit {exc.code}: {capsys.readouterr().out}")
    report = json.loads(out.read_text())
    assert report["verified"] and report["spec"] == "off" and report["request_mode"] == "plain"
    assert 0 < report["users"] <= 20 and report["concurrency"] == 6 and report["balanced_connections"]
    assert "--spec" in report["serve_args"] and "off" in report["serve_args"]
    one, two = report["rows"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert set(report["throughput_ratio"]) == {"2/1"} and report["throughput_ratio"]["2/1"] > 0
    for row in (one, two):
        assert row["ok"] > 0 and row["errors"] == {} and row["throughput_rps"] > 0
        assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
        assert row["exit_code"] == 0 and row["worker_exit_codes"] == [0] * row["processes"]
        assert row["workers_served"] == row["processes"] == len(row["workers"])
        assert sum(row["connections_per_worker"]) == 6 and row["client_cpu_s"] >= 0
        assert row["server_cpu_s"] > 0 and 0 <= row["host_cpu_busy"] <= 1
        # the workers' own counters: every answer the client counted in the window, give or take the calls
        # in flight at its edges
        assert abs(sum(w["ok"] for w in row["workers"]) - row["ok"]) <= 2 * 6
    assert two["connections_per_worker"] == [3, 3]  # balanced: each worker has its share of the connections
    assert one["speculation_per_width"] == two["speculation_per_width"] == {"1": [0, 0]}  # serve --spec off: plain
    assert two["threads_per_worker"] == [1, 1]  # serve's default with --processes > 1: one torch thread each
    assert all(w["ok"] > 0 and w["cpu_s"] > 0 for w in two["workers"])
    assert len({w["pid"] for w in two["workers"]}) == 2
    table = capsys.readouterr().out
    assert table.startswith("| processes | threads/worker | req/s |") and "throughput ratio: 2/1:" in table


@pytest.mark.parametrize("flags, message", [
    (["--processes", "0,2"], "--processes"),
    (["--processes", "2,2"], "--processes"),
    (["--concurrency", "0"], "--concurrency"),
    (["--duration", "0"], "--duration"),
    (["--k", "51"], "--k"),
    (["--spec", "fast"], "--spec"),
    (["--threads", "0"], "--threads"),
])
def test_bad_flags_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "processes", "--bundle", "b", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_not_a_bundle_exits_2(tmp_path, capsys):
    assert main(["bench", "processes", "--bundle", str(tmp_path), "--duration", "1"]) == 2
    assert "not a bundle" in capsys.readouterr().err


def test_serve_threads_and_spec_off_flags(capsys):
    from recsvc.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--popularity", "p.json", "--threads", "2", "--spec", "off"])
    assert args.threads == 2 and args.spec == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--popularity", "p.json", "--threads", "0"])
