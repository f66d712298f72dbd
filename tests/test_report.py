"""`recsvc report`: plots from the real outputs of `recsvc build` (its training record), `recsvc eval --json` and
`recsvc bench decode|speculative|cache|serve|replay --json` on a tiny bundle; the files are checked as written
(PNG signature and size, the SVG's text: titles, axis labels, legends, machine and precision), and every bad
input exits 2 with a message naming it."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_fixtures import make_data, one_thread, write_ids  # noqa: F401 (one_thread: a fixture)

from recsvc.cli.main import main
from recsvc.hardware import cpu_model

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A tiny bundle trained for 2 epochs (its training record), then the eval and bench JSON of it."""
    root = tmp_path_factory.mktemp("report")
    data = make_data(root, n_users=40)
    ids = write_ids(data, root / "ids.json")
    bundle = root / "bundle"
    assert main(["build", "--data", str(data), "--out", str(bundle), "--ids", str(ids), "--preset", "tiny",
                 "--epochs", "2", "--batch-size", "8", "--eval-users", "10", "--bf16", "off", "--threads", "1"]) == 0
    out = root / "json"
    files = {"eval": out / "eval_test.json", "decode": out / "decode.json", "spec": out / "spec_oracle.json",
             "cache": out / "cache.json", "serve": out / "serve.json"}
    assert main(["eval", "--bundle", str(bundle), "--split", "test", "--k", "3,5", "--dtype", "fp32",
                 "--baselines", "popularity,transition", "--json", str(files["eval"])]) == 0
    assert main(["bench", "decode", "--bundle", str(bundle), "--users", "3", "--k", "1,3", "--warmup", "1",
                 "--dtype", "fp32", "--threads", "1", "--json", str(files["decode"])]) == 0
    assert main(["bench", "speculative", "--bundle", str(bundle), "--users", "3", "--k", "1,3", "--drafter",
                 "oracle", "--grid", "K:3", "--calibration-users", "2", "--dtype", "fp32", "--threads", "1",
                 "--json", str(files["spec"])]) == 0
    assert main(["bench", "cache", "--bundle", str(bundle), "--users", "3", "--k", "3", "--beam-width", "5",
                 "--threads", "1", "--warmup", "1", "--sweep-users", "2", "--no-compiled",
                 "--json", str(files["cache"])]) == 0
    assert main(["bench", "serve", "--bundle", str(bundle), "--concurrency", "1,2", "--duration", "0.4", "--k", "3",
                 "--batching", "both", "--users", "4", "--history-len", "3", "--dtype", "fp32",
                 "--json", str(files["serve"])]) == 0
    return {"bundle": bundle, **files}


def svg_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    return text


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def check_pair(out: Path, name: str, *texts: str) -> str:
    """Both files of one plot: a PNG of a readable size under 400 kB, an SVG holding ``texts``."""
    png, svg = out / f"{name}.png", out / f"{name}.svg"
    width, height = png_size(png)
    assert 600 <= width <= 1400 and 300 <= height <= 1000, (name, width, height)
    assert 0 < png.stat().st_size < 400_000 and 0 < svg.stat().st_size < 400_000
    text = svg_text(svg)
    missing = [t for t in texts if t not in text]
    assert not missing, f"{name}.svg lacks {missing}"
    return text


def test_report_plots_every_kind_from_real_runs(runs, tmp_path, capsys) -> None:
    out = tmp_path / "img"
    argv = ["report", "--out", str(out), "--label", "tiny synthetic", "--machine", "test CPU, 1 thread",
            str(runs["eval"]), str(runs["decode"]), str(runs["spec"]), str(runs["cache"]), str(runs["serve"]),
            str(runs["bundle"])]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote 14 files to {out}" in printed
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{n}.{ext}" for n in ("eval_test_quality", "eval_test_cold_warm", "decode_latency", "spec_oracle_latency",
                               "cache_latency", "serve_throughput", "target_training_curves")
        for ext in ("png", "svg"))
    ev = json.loads(runs["eval"].read_text())
    # quality: every method's bars, the lead over each baseline with its interval, the data and precision
    quality = check_pair(out, "eval_test_quality", "tiny synthetic: recommendation quality",
                         "Recall@K per method", "NDCG@K per method", "popularity", "transition",
                         "model / popularity", "model / transition", "95% paired bootstrap interval",
                         "cutoff K (items recommended)", "Recall@K (share of the held-out items in the top K)",
                         f"test split, {int(ev['users'])} users", "no prior, no fresh slots",
                         f"precision: fp32 | machine: {cpu_model()}")  # recsvc eval records its machine
    assert f"{ev['model']['recall@5']:.3f}" in quality  # the bars carry their values
    check_pair(out, "eval_test_cold_warm", "cold targets", "warm targets",
               f"{int(ev['model']['warm']['users'])} users", "precision: fp32")
    # decode and speculative: latency against K, the baseline beside the engine, the machine from the JSON
    machine = json.loads(runs["decode"].read_text())["machine"]
    assert cpu_model() in machine
    check_pair(out, "decode_latency", "transformers generate + trie callback (baseline)", "engine beam search",
               "latency (ms per request, mean)", "K (items per request; beams searched)", f"machine: {cpu_model()}",
               "precision: fp32 on cpu")
    check_pair(out, "spec_oracle_latency", "strict speculative beam search, oracle drafter",
               "plain beam search (baseline)", "speculative, N = K, gamma = 3", "auto (chosen on validation users)",
               "WS@K: plain ms / speculative ms (x)", "precision: fp32 on cpu")
    check_pair(out, "cache_latency", "cached vs uncached requests", "lean: every beam fed (uncached, baseline)",
               "returning user: prompt state cached", "latency (ms per request, median)", "precision: fp32")
    check_pair(out, "serve_throughput", "the gRPC service under load", "max batch 1, mode plain (baseline)",
               "max batch 16, mode plain", "concurrent callers", "p99 latency (ms per call)",
               "throughput (successful Recommend calls/s)", f"machine: {cpu_model()}", "precision: fp32")
    record = json.loads((runs["bundle"] / "target" / "training.json").read_text())
    assert len(record["history"]) == 2
    check_pair(out, "target_training_curves", "training curves of the target (target/training.json)",
               "validation loss", "train loss", "loss (cross-entropy, nats per labelled token)", "Recall@10",
               "epoch (passes over the training windows)", f"selected: epoch {record['best_epoch']}",
               "tiny preset", "bf16 autocast off", "machine: test CPU, 1 thread")


def test_report_says_where_machine_and_precision_are_not_recorded(runs, tmp_path) -> None:
    """An evaluation written before recsvc eval recorded its machine: the title says so."""
    out = tmp_path / "img"
    older = tmp_path / "eval_test.json"
    older.write_text(json.dumps({k: v for k, v in json.loads(runs["eval"].read_text()).items() if k != "machine"}))
    assert main(["report", "--out", str(out), "--formats", "svg", str(older)]) == 0
    assert not list(out.glob("*.png"))
    text = svg_text(out / "eval_test_quality.svg")
    assert "machine: not recorded (pass --machine)" in text and "precision: fp32" in text


def test_replay_throughput_against_concurrency(runs, tmp_path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server, or `make redis`)")
    replay = tmp_path / "replay.json"
    assert main(["bench", "replay", "--bundle", str(runs["bundle"]), "--users", "4", "--r", "1", "--k", "3",
                 "--concurrency", "1,2", "--cache", "off,on", "--threads", "1", "--max-seconds", "2",
                 "--json", str(replay)]) == 0
    assert json.loads(replay.read_text())["dtype"] == "fp32"
    out = tmp_path / "img"
    assert main(["report", "--out", str(out), str(replay)]) == 0
    check_pair(out, "replay_throughput", "per state-cache configuration", "state cache off (baseline)",
               "state cache on", "throughput (calls/s: Recommend + Record)",
               "p99 latency (ms per call)", "concurrent callers", f"machine: {cpu_model()}", "precision: fp32")


def bad(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name
    path.write_text(content)
    return path


def test_bad_inputs_exit_2_with_a_message_and_write_nothing(runs, tmp_path, capsys) -> None:
    out = tmp_path / "img"
    ev = json.loads(runs["eval"].read_text())
    broken = {k: v for k, v in ev.items() if k != "ks"}
    other = tmp_path / "other"
    other.mkdir()
    cases = [
        ([str(tmp_path / "absent.json")], "absent.json: no such file"),
        ([str(bad(tmp_path, "trunc.json", runs["decode"].read_text()[:40]))], "trunc.json: not valid JSON (line"),
        ([str(bad(tmp_path, "list.json", "[1, 2]"))], "list.json: expected a JSON object, got list"),
        ([str(bad(tmp_path, "other.json", '{"items": []}'))], "other.json: not a layout `recsvc report` reads"),
        ([str(bad(tmp_path, "fuzz.json", '{"bench": "fuzz", "rows": []}'))],
         "`recsvc bench fuzz` output has no plot"),
        ([str(bad(tmp_path, "noks.json", json.dumps(broken)))], "noks.json: not a layout"),
        ([str(tmp_path)], "a directory without a target training record"),
        ([str(runs["eval"]), str(bad(other, "eval_test.json", runs["eval"].read_text()))],
         "would write the same plots (eval_test_*)"),
        ([], "no input files"),
        (["--formats", "pdf", str(runs["eval"])], "--formats takes png and/or svg"),
    ]
    for argv, message in cases:
        assert main(["report", "--out", str(out), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, (argv, err)
    assert not out.exists()
    # a known layout with a field missing: the plot fails with the file named
    gone = {**ev, "model": {k: v for k, v in ev["model"].items() if k != "recall@5"}}
    assert main(["report", "--out", str(out), str(bad(tmp_path, "partial.json", json.dumps(gone)))]) == 2
    err = capsys.readouterr().err
    assert "partial.json: malformed eval JSON (KeyError: 'recall@5')" in err and "Traceback" not in err


def test_make_report_plots_the_files_the_bench_targets_write(runs, tmp_path) -> None:
    """`make report` over a BENCH folder holding some of the files the Beauty targets write (the others are
    skipped) and the bundle's training record; with none of them, exit 2 and say which targets write them."""
    venv = Path(sys.executable).parent.parent
    if shutil.which("make") is None or not (venv / "bin" / "recsvc").exists():
        pytest.skip("needs make and the recsvc console script beside this interpreter")
    bench = tmp_path / "bench"
    bench.mkdir()
    for key, name in (("eval", "quality_deploy.json"), ("decode", "decode.json"), ("cache", "cache.json")):
        shutil.copy(runs[key], bench / name)
    out = tmp_path / "img"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    make = ["make", "-s", "-o", f"{venv}/.installed-stamp", "report", f"VENV={venv}", f"BENCH={bench}",
            f"REPORT_OUT={out}", "REPORT_LABEL=tiny synthetic", "REPORT_MACHINE=test CPU"]
    done = subprocess.run([*make, f"BUNDLE={runs['bundle']}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.glob("*.png")) == [
        "cache_latency.png", "decode_latency.png", "quality_deploy_cold_warm.png", "quality_deploy_quality.png",
        "target_training_curves.png"]
    check_pair(out, "quality_deploy_quality", "tiny synthetic: recommendation quality", f"machine: {cpu_model()}")
    check_pair(out, "target_training_curves", "machine: test CPU")
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([*make[:-4], f"BENCH={empty}", f"BUNDLE={empty}", f"REPORT_OUT={tmp_path / 'none'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "make report: no eval / bench JSON" in done.stderr
    assert not (tmp_path / "none").exists()


def test_draft_head_curves_from_its_config(runs, tmp_path) -> None:
    """A draft head's record (BUNDLE/heads/NAME/config.json, written by `recsvc train head`) plots as curves."""
    assert main(["train", "head", "--bundle", str(runs["bundle"]), "--method", "wordkd", "--alpha", "0.5",
                 "--k", "3", "--prefixes", "60", "--epochs", "2", "--threads", "1", "--out-name", "wk"]) == 0
    out = tmp_path / "img"
    assert main(["report", "--out", str(out), str(runs["bundle"] / "heads" / "wk" / "config.json")]) == 0
    check_pair(out, "wk_config_curves", "training curves of the draft head (wordkd)", "validation loss",
               "validation alignment loss", "top-K containment", "selected: epoch")
