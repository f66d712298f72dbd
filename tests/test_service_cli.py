"""``recsvc client ...`` output and exit codes, and ``recsvc serve`` as a process draining on SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from service_helpers import json_line

from harness.redis_server import free_port
from recsvc.client import cli as client_cli
from recsvc.client.client import RecClient
from recsvc.service import cli as serve_cli

REPO = Path(__file__).resolve().parents[1]


def _client(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="recsvc")
    sub = parser.add_subparsers(dest="command")
    client_cli.register(sub)
    args = parser.parse_args(["client", *argv])
    return args.func(args)


def test_client_cli_round_trip_json(catalog, make_server, capsys):
    target = make_server(catalog).address
    assert _client(["record", "--target", target, "--user", "u", "--items", "4,5"]) == 0
    assert json.loads(capsys.readouterr().out) == {"user_id": "u", "history_length": 2}
    assert _client(["history", "--target", target, "--user", "u"]) == 0
    assert json.loads(capsys.readouterr().out)["item_ids"] == [4, 5]
    assert _client(["recommend", "--target", target, "--user", "u", "--k", "3", "--exclude-history"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [i["item_id"] for i in out["items"]] == [1, 2, 3] and out["stats"]["requested_mode"] == "strict"
    assert out["stats"]["mode"] == "popularity"  # what answered: a popularity table, no decoding
    assert (
        _client(["recommend", "--target", target, "--user", "v", "--history", "1,2", "--mode", "plain"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["stats"]["requested_mode"] == "plain"
    assert _client(["health", "--target", target]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "SERVING"}


def test_client_cli_errors_exit_codes_without_traceback(catalog, make_server, capsys):
    target = make_server(catalog, api_key="key").address
    assert _client(["recommend", "--target", target, "--user", "u", "--k", "0", "--api-key", "key"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: k must be between 1 and 50") and "Traceback" not in err
    assert _client(["history", "--target", target, "--user", "u"]) == 1
    assert "error: UNAUTHENTICATED: missing API key" in capsys.readouterr().err
    dead = f"127.0.0.1:{free_port()}"
    assert _client(["history", "--target", dead, "--user", "u", "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(("error: UNAVAILABLE", "error: DEADLINE_EXCEEDED")) and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        _client(["recommend", "--target", target, "--user", "u", "--history", "1,x"])
    assert exc.value.code == 2


def test_serve_subcommand_registers():
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--popularity", "p.json", "--port", "0", "--default-mode", "plain"])
    assert args.func is serve_cli.run_serve and args.max_batch == 16 and args.max_k == 50



def test_serve_process_drains_on_sigterm(tmp_path):
    counts = tmp_path / "pop.json"
    counts.write_text(json.dumps({str(i): 100 - i for i in range(1, 60)}))
    env = {**os.environ, "RECSVC_API_KEY": "envkey", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "recsvc.cli.main",
        "serve",
        "--popularity",
        str(counts),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--grace-s",
        "2",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        address = None
        deadline = time.monotonic() + 30
        lines = []
        while address is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            entry = json_line(line)
            if entry.get("event") == "serving":
                address = entry["address"]
        assert address, "".join(lines)
        with RecClient(address, api_key="envkey") as client:
            assert client.record("u", [3]) == 1
            assert [i.item_id for i in client.recommend("u", k=2, exclude_history=True).items] == [1, 2]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        events = [json_line(line).get("event") for line in proc.stderr.read().splitlines()]
        assert "signal_received" in events and "draining" in events
        assert [e for e in events if e][-1] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_bad_popularity_file_is_a_clear_user_error(tmp_path, capsys):
    from recsvc.cli.main import main

    bad = tmp_path / "pop.json"
    bad.write_text("[1, 2]")
    assert main(["serve", "--popularity", str(bad), "--port", "0"]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


def test_serve_drafter_flag_errors_are_clear(tmp_path, capsys):
    from recsvc.cli.main import main

    pop = tmp_path / "pop.json"
    pop.write_text('{"1": 3}')
    assert main(["serve", "--popularity", str(pop), "--drafter", "aligned", "--port", "0"]) == 2
    assert "--drafter needs --bundle" in capsys.readouterr().err
