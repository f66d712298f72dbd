"""CLI hardening: every ``recsvc ... --help`` works, bad flag values are ``error: ...`` with exit code 2 (never a
traceback), port ranges, and the bounded ``--spec auto`` start-up calibration."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from service_helpers import json_line

from recsvc.cli.main import build_parser, main
from recsvc.client.client import RecClient
from recsvc.recommender.bundle_recommender import SpecSettings
from recsvc.service.startup import calibration

REPO = Path(__file__).resolve().parents[1]


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the argparse tree: (), ("bench",), ("bench", "seeds"), ..."""
    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*path, name))
    return out


COMMANDS = _commands(build_parser())


def test_the_command_tree_was_found():
    assert {("serve",), ("bench",), ("client",), ("client", "recommend"), ("bench", "seeds")} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "recsvc")
def test_every_help_exits_0(path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*path, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: ") and "Traceback" not in out.err


def test_bench_help_as_a_process():
    proc = subprocess.run(
        [sys.executable, "-m", "recsvc.cli.main", "bench", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "95% CI" in proc.stdout and "Traceback" not in proc.stderr


BAD_SERVE_FLAGS = [
    (["--log-level", "LOUD"], "--log-level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    (["--redis-ttl-s", "0"], "--redis-ttl-s: must be >= 1, got 0"),
    (["--redis-ttl-s", "-5"], "--redis-ttl-s: must be >= 1"),
    (["--redis-ttl-s", "soon"], "--redis-ttl-s: not an integer"),
    (["--redis-url", "notaurl"], "--redis-url: expected redis://host:port/db"),
    (["--redis-url", "redis://"], "--redis-url: a Redis URL needs a host"),
    (["--redis-url", "redis://h:99999/0"], "--redis-url: not a valid Redis URL"),
    (["--redis-url", "redis://h:6379/x"], "the Redis database must be a number"),
    (["--port", "99999"], "--port: must be between 0 and 65535 (0 = any free port), got 99999"),
    (["--port", "-1"], "--port: must be between 0 and 65535 (0 = any free port), got -1"),
    (["--port", "65536"], "--port: must be between 0 and 65535"),
    (["--port", "http"], "--port: not a port number"),
    (["--metrics-port", "70000"], "--metrics-port: must be between 0 and 65535"),
    (["--metrics-port", "-2"], "--metrics-port: must be between 0 and 65535"),
    (["--startup-budget-s", "0"], "--startup-budget-s: must be a finite number > 0"),
    (["--startup-budget-s", "nan"], "--startup-budget-s: must be a finite number > 0"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_SERVE_FLAGS, ids=[" ".join(f) for f, _ in BAD_SERVE_FLAGS])
def test_bad_serve_flags_exit_2_with_error(tmp_path, flags, message, capsys):
    pop = tmp_path / "pop.json"
    pop.write_text('{"1": 3}')
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--popularity", str(pop), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err and "Traceback" not in err


def test_good_serve_flag_values_parse():
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--popularity", "p.json", "--port", "0", "--metrics-port", "65535", "--log-level", "debug",
         "--redis-url", "redis://:pw@127.0.0.1:6379/2", "--redis-ttl-s", "1"]
    )
    assert (args.port, args.metrics_port, args.log_level, args.redis_ttl_s) == (0, 65535, "DEBUG", 1)
    assert parser.parse_args(["serve", "--popularity", "p", "--redis-url", "unix:///tmp/r.sock"]).redis_url
    assert parser.parse_args(["serve", "--popularity", "p"]).startup_budget_s == 60.0


def test_server_config_rejects_out_of_range_ports():
    from recsvc.errors import UserError
    from recsvc.service.rpc.server import ServerConfig

    for bad in (dict(port=99999), dict(port=-1), dict(metrics_port=65536)):
        with pytest.raises(UserError, match="must be between 0 and 65535"):
            ServerConfig(**bad).check()


# --- bounded start-up calibration ---------------------------------------------------------------------------


@dataclass
class _SlowEngine:
    """Stands in for BundleRecommender in calibration: each strict batch costs ``cost_s`` seconds (half when it
    speculates); the served beam width 0 (each request's k), so the widths calibrated are the Ks."""

    cost_s: float = 0.05
    drafter: object = "drafter"
    spec: SpecSettings = field(default_factory=SpecSettings)
    beam_width: int = 0  # B: requests of k items decode max(k, B) beams
    calls: list = field(default_factory=lambda: [0])  # shared by the variants
    widths: list = field(default_factory=list)  # the width of every batch timed (shared by the variants)

    def popular_items(self, k, exclude=()):
        return list(range(1, k + 1))

    def served_widths(self, ks):
        return sorted({max(k, self.beam_width) for k in ks})

    def variant(self, *, spec):
        return replace(self, spec=spec)

    def recommend(self, queries):
        self.calls[0] += 1
        self.widths.append(max(queries[0].k, self.beam_width))
        n = self.spec.for_width(queries[0].k)[0]
        time.sleep(self.cost_s * (1.0 if n == 0 else 0.5))  # speculation pays on this fake hardware
        return []


def test_calibration_within_budget_tunes_every_width():
    engine = _SlowEngine(cost_s=0.001)
    steps = []
    spec = calibration.calibrate_speculation(
        engine, "auto", None, budget_s=30, step=lambda event, *a, **f: steps.append((event, f))
    )
    assert set(spec.per_width) == {1, 5, 10, 20} and all(n > 0 for n, _ in spec.per_width.values())
    assert engine.spec.per_width is None  # the engine it timed is not changed: the caller builds with the choice
    assert [e for e, _ in steps].count("calibrated") == 4


def test_calibration_over_budget_serves_plain_for_the_untuned_widths():
    engine = _SlowEngine(cost_s=0.05)  # one width costs ~7 candidates x 3 runs x 25-50 ms ~ 0.6-1 s
    steps = []
    started = time.monotonic()
    spec = calibration.calibrate_speculation(
        engine, "auto", None, budget_s=1.2, step=lambda event, *a, **f: steps.append((event, f))
    )
    assert time.monotonic() - started < 1.2 + 0.2  # a run that would end past the budget is not started
    events = dict(steps)
    assert "calibration_budget_exhausted" in events
    untuned = events["calibration_budget_exhausted"]["untuned_widths"]
    assert untuned and untuned[-1] == 20 and 1 not in untuned
    assert all(spec.per_width[w] == (0, 0) for w in untuned)  # plain decoding at the widths not tuned in time
    assert all(spec.plain_reason(w).startswith("not calibrated within") for w in untuned)
    assert set(spec.per_width) == {1, 5, 10, 20}


def test_calibration_stops_on_a_signal():
    engine = _SlowEngine(cost_s=0.01)
    spec = calibration.calibrate_speculation(
        engine, "auto", None, budget_s=60, step=lambda *a, **f: None, should_stop=lambda: engine.calls[0] >= 3
    )
    assert spec.per_width == {1: (0, 0), 5: (0, 0), 10: (0, 0), 20: (0, 0)}


def test_calibration_runs_at_the_served_widths_only():
    """A served width B >= every calibrated k: requests of k = 1, 5, 10, 20 all decode B beams, so B alone is
    timed (its choice is the one every request reads)."""
    engine = _SlowEngine(cost_s=0.001, beam_width=20)
    steps = []
    spec = calibration.calibrate_speculation(engine, "auto", None, budget_s=30,
                                             step=lambda event, *a, **f: steps.append((event, f)))
    assert set(engine.widths) == {20} and set(spec.per_width) == {20}
    assert [f["width"] for e, f in steps if e == "calibrated"] == [20]


# --- the serve process: start-up steps, serving line, prompt exit after SIGTERM ---------------------------------



def test_serve_process_logs_start_up_and_exits_within_2s_of_sigterm(tmp_path):
    counts = tmp_path / "pop.json"
    counts.write_text(json.dumps({str(i): 100 - i for i in range(1, 60)}))
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--popularity", str(counts), "--port", "0",
           "--metrics-port", "0", "--grace-s", "5"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        events: list[dict] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if json_line(line):
                events.append(json_line(line))
            if events and events[-1].get("event") == "serving":
                break
        names = [e.get("event") for e in events]
        assert names.index("listening") < names.index("loading_popularity") < names.index("serving"), names
        serving = events[-1]
        assert serving["popularity"] == str(counts) and serving["decoding"] == "popularity"
        assert serving["port"] > 0 and serving["metrics_port"] > 0 and "startup_s" in serving
        with RecClient(serving["address"]) as client:
            assert client.health() == "SERVING"
            assert client.recommend("u", history=[3], k=2).items
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert proc.wait(20) == 0
            assert time.monotonic() - signalled < 2.0
        tail = [json_line(line).get("event") for line in proc.stderr.read().splitlines()]
        assert "draining" in tail and [e for e in tail if e][-1] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
