"""``recsvc bench failover``: a short drill end to end (a real 6-node cluster, ``recsvc serve`` as a process, a
master SIGKILLed mid-load and restarted), its ledger arithmetic, and its argument errors."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.failover_load import lost_writes


def test_lost_writes_counts_missing_acknowledged_items():
    acked = {"a": [1, 2, 3], "b": [1]}
    histories = {"a": [1, 3, 3, 4], "b": [1], "c": []}
    assert lost_writes(acked, histories) == {"lost": 1, "stored_but_not_acknowledged": 1, "duplicates": 1}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cluster", "redis+cluster://127.0.0.1:7000"], "--cluster takes 'spawn' only"),
        (["--duration", "5", "--kill-at", "6"], "--kill-at must fall inside --duration"),
    ],
)
def test_bad_arguments_exit_2(capsys, flags, message):
    from recsvc.cli.main import main

    assert main(["bench", "failover", *flags]) == 2
    assert message in capsys.readouterr().err


def test_duration_must_be_positive(capsys):
    from recsvc.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "failover", "--duration", "0"])
    assert exit_info.value.code == 2 and "must be > 0" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                    reason="redis-server / redis-cli are not installed")
def test_short_drill_with_wait_on(tmp_path, capsys):
    from recsvc.cli.main import main

    out = tmp_path / "drill.json"
    code = main(["bench", "failover", "--duration", "9", "--kill-at", "2", "--rejoin-after", "3", "--concurrency", "4",
                 "--users-per-thread", "4", "--node-timeout-ms", "1000", "--wait-replicas", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["verified"], report
    assert report["server_crashes"] == 0 and report["server"]["exit_code"] == 0
    assert report["unexpected_errors"] == 0 and set(report["errors_by_code"]) <= {"UNAVAILABLE"}
    assert report["calls"]["recommend_inline"].keys() == {"OK"}
    assert report["lost"] == 0 and report["acknowledged_writes"] > 0 and report["unread_users"] == 0
    assert report["timeline_s"]["promoted_after_kill"] is not None
    assert report["timeline_s"]["resynced_after_kill"] is not None
    recovered = report["recovery_after_kill_s"]["all"]  # s from the kill to the last failed call
    if recovered is None:  # nothing failed after the kill: the client's retries hid the failover
        assert sum(report["errors_by_code"].values()) == sum(report["errors_before_kill"].values())
    else:  # failures stopped before the end of the drill (not "not recovered"), after the kill
        assert isinstance(recovered, float) and 0 <= recovered < 9 - 2, recovered
    assert "| record |" in capsys.readouterr().out
