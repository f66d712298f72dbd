"""What a batch run's log holds: progress bars only on a terminal (or when asked), plain lines at most once per
interval otherwise, ``TQDM_DISABLE=1`` honoured; a real ``recsvc build`` step with its output redirected to a
file, its lines and ``\\r`` redraws counted. And a server's per-call rejections (a burst of calls while it
starts) logged at most once a second with a count, every one of them counted in its metrics."""

from __future__ import annotations

import io
import logging
import math
import os
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import grpc
import pytest
from service_helpers import Records
from test_train_fixtures import make_data, write_ids

from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.gen import recommender_pb2_grpc as pb_grpc
from recsvc.service.rpc.server import RecServer, ServerConfig
from recsvc_base.progress import LineProgress, print_record, progress_bar, progress_mode

REPO = Path(__file__).resolve().parents[1]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RECSVC_PROGRESS", "RECSVC_PROGRESS_INTERVAL_S", "TQDM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _run_bar(stream, seconds: float = 1.2, step_s: float = 0.01) -> None:
    bar = progress_bar(total=int(seconds / step_s), desc="work", unit="step", file=stream)
    for i in range(int(seconds / step_s)):
        time.sleep(step_s)
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")  # refreshes on every call, as the training loops do
    bar.close()


def test_the_form_follows_the_stream_and_the_environment(clean_env) -> None:
    assert progress_mode(_Tty()) == "bar" and progress_mode(io.StringIO()) == "line"
    assert progress_mode(_Tty(), enabled=False) == "off"
    clean_env.setenv("RECSVC_PROGRESS", "line")
    assert progress_mode(_Tty()) == "line"
    clean_env.setenv("RECSVC_PROGRESS", "bar")
    assert progress_mode(io.StringIO()) == "bar"
    clean_env.setenv("TQDM_DISABLE", "1")  # tqdm's own switch wins over everything
    assert progress_mode(_Tty()) == "off"


def test_a_terminal_gets_redrawn_bars_and_tqdm_disable_silences_them(clean_env) -> None:
    tty = _Tty()
    _run_bar(tty, seconds=0.3)
    assert tty.getvalue().count("\r") > 3 and "work:" in tty.getvalue()
    clean_env.setenv("TQDM_DISABLE", "1")
    quiet = _Tty()
    _run_bar(quiet, seconds=0.3)
    assert quiet.getvalue() == ""


def test_line_mode_writes_at_most_one_line_per_interval_and_a_summary(clean_env) -> None:
    clean_env.setenv("RECSVC_PROGRESS_INTERVAL_S", "0.25")
    out = io.StringIO()
    began = time.monotonic()
    _run_bar(out, seconds=1.3)
    elapsed = time.monotonic() - began
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # progress lines no closer than the interval (the first after one interval), then the closing summary
    assert 2 <= len(lines) <= math.floor(elapsed / 0.25) + 1, lines
    assert lines[-1].startswith("work: 100% 130/130") and "loss=" in lines[-1]
    short = io.StringIO()
    _run_bar(short, seconds=0.1)  # shorter than the interval: nothing at all
    assert short.getvalue() == ""
    assert isinstance(progress_bar(range(3), file=io.StringIO()), LineProgress)


# --- a real build step, its output redirected to a file ------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("logs")
    d = make_data(root, n_users=60)
    return d, write_ids(d, root / "ids.json")


def _build(data, out: Path, log: Path, epochs: int, **env: str) -> float:
    """``recsvc build`` (tiny preset) as a batch job: stdout and stderr to ``log``; returns its wall time."""
    d, ids = data
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RECSVC_PROGRESS", "RECSVC_PROGRESS_INTERVAL_S", "TQDM_DISABLE")}
    environ.update(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    began = time.monotonic()
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-m", "recsvc.cli.main", "build", "--data", str(d), "--out", str(out),
                        "--ids", str(ids), "--preset", "tiny", "--epochs", str(epochs), "--batch-size", "4",
                        "--eval-users", "20", "--bf16", "off", "--threads", "1"],
                       stdout=fh, stderr=subprocess.STDOUT, env=environ, check=True, timeout=600)
    return time.monotonic() - began


def _lines(text: str) -> int:
    """Lines as a file viewer counts them with every '\\r' redraw made a line of its own."""
    return text.count("\n") + text.count("\r")


def test_a_build_step_redirected_to_a_file_is_plain_lines(data, tmp_path) -> None:
    log = tmp_path / "build.log"
    _build(data, tmp_path / "b", log, epochs=2)
    text = log.read_text()
    assert "\r" not in text and "[target] finished" in text
    # the stage lines and one line per epoch: under 200 lines for the hour budget even for this short run
    assert _lines(text) <= 16, text

    # with a short interval the same run reports progress in batch mode, one line per interval at most
    fast = tmp_path / "fast.log"
    # (0.01 s: an epoch's bar of 25 steps outlasts it even on a fast, idle machine)
    wall = _build(data, tmp_path / "b2", fast, epochs=4, RECSVC_PROGRESS_INTERVAL_S="0.01")
    text = fast.read_text()
    progress = [line for line in text.splitlines() if "%" in line and "/" in line and "[" in line]
    assert "\r" not in text and progress, text
    closing = sum(1 for line in progress if " 100% " in line)  # a bar that ran for an interval sums up once
    assert len(progress) - closing <= wall / 0.01 + 1, (len(progress), wall)
    assert any(line.startswith("target epoch") for line in progress)


def test_tqdm_disable_silences_a_build_even_when_bars_are_asked_for(data, tmp_path) -> None:
    log = tmp_path / "quiet.log"
    _build(data, tmp_path / "b", log, epochs=1, RECSVC_PROGRESS="bar", TQDM_DISABLE="1")
    text = log.read_text()
    assert "\r" not in text and "it/s" not in text and "[target] finished" in text


def test_optuna_trials_in_batch_mode_are_plain_lines(clean_env, capsys) -> None:
    """A tune step's Optuna search (``run_trials``) redirected to a file: no bar redraws, at most a line per
    interval and the closing summary with the best trial; on a terminal Optuna's own bar."""
    import optuna

    from training.tuning.studies import run_trials

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    clean_env.setenv("RECSVC_PROGRESS_INTERVAL_S", "0.05")

    def objective(trial) -> float:
        time.sleep(0.02)
        return trial.suggest_float("x", 0.0, 1.0)

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    assert run_trials(study, objective, trials=12, minutes=1.0) == 12
    err = capsys.readouterr().err
    assert "\r" not in err and "Best trial" not in err, err
    lines = err.splitlines()
    assert 1 <= len(lines) <= 12 and lines[-1].startswith("trials (1 min budget): 100% 12/12"), lines
    assert f"best={study.best_value:.5f}@{study.best_trial.number}" in lines[-1]
    assert run_trials(study, objective, trials=12, minutes=1.0) == 0  # finished: nothing more to run
    assert all(a != b for a, b in pairwise(lines)), lines  # the closing line repeats no line just written


def test_a_result_record_is_one_line_in_a_log_and_indented_at_a_terminal() -> None:
    import json

    record = {"settings": {"weight": 1.5, "window": 3}, "valid": {"ndcg@10": 0.0258}, "trials": 30}
    log, tty = io.StringIO(), _Tty()
    print_record(record, log)
    print_record(record, tty)
    assert log.getvalue().count("\n") == 1 and json.loads(log.getvalue()) == record
    assert tty.getvalue().count("\n") > 5 and json.loads(tty.getvalue()) == record


# --- rejections: counted every time, logged once a second --------------------------------------------------


def test_a_burst_of_rejected_calls_is_counted_every_time_and_logged_once_a_second() -> None:
    handler = Records()
    logger = logging.getLogger("recsvc")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    server = RecServer(None, None, ServerConfig(max_wait_ms=2.0)).start()  # listening, engine not attached
    seen: list[str] = []
    lock = threading.Lock()
    try:
        channel = grpc.insecure_channel(server.address)  # no retry policy: every call reaches the server once
        stub = pb_grpc.RecommenderStub(channel)
        stop = time.monotonic() + 2.5

        def caller() -> None:
            while time.monotonic() < stop:
                try:
                    stub.Recommend(pb.RecommendRequest(user_id="u", history=[1], k=2), timeout=5)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with lock:
                    seen.append(code)

        threads = [threading.Thread(target=caller) for _ in range(4)]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - began
        channel.close()
        counted = server.metrics.registry.get_sample_value(
            "recsvc_rejected_total", {"method": "Recommend", "reason": "starting"})
    finally:
        server.stop(grace_s=0.2)
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert len(seen) > 50 and set(seen) == {"UNAVAILABLE"}
    assert counted == len(seen)  # every rejection in the metrics
    lines = [r for r in handler.records if r.getMessage() == "rpc" and r.fields.get("code") == "UNAVAILABLE"]
    assert 1 <= len(lines) <= math.ceil(elapsed) + 1, len(lines)
    assert all(r.fields["error"] == "server is starting up" for r in lines)
    counts = [r.fields["count"] for r in lines]
    assert counts[0] == 1 and sum(counts) <= len(seen) and max(counts) > 10, counts
    gaps = [b.created - a.created for a, b in zip(lines, lines[1:], strict=False)]
    assert all(g >= 0.99 for g in gaps), gaps
