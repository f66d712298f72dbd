"""Sharded offline evaluation: `torchrun --nproc_per_node 2 -m recsvc.cli.main eval` on a tiny bundle gives exactly
the single-process figures (same users, same batches, so the same rankings), rank 0 alone prints and writes the
JSON, which records the process count; and the shard/gather helpers in-process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.bundle.directory import Bundle
from recsvc.data.split import load_split_dir
from tokenizer_rqvae.trie import CatalogTrie
from training.evaluation.ranking import rank_users, serving_model

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("sharded"), n_users=40)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
           "TQDM_DISABLE": "1", "PYTHONFAULTHANDLER": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    return proc, time.perf_counter() - start


def _ranking_inputs(bundle: Path):
    """(served target, prompt builder, trie, test users) of the tiny bundle, as ``recsvc eval`` builds them."""
    b = Bundle.open(bundle)
    ids = b.load_ids()
    users = load_split_dir(b.resolve_data_dir(None)).eval_users("test")
    return serving_model(b.load_target(dtype="fp32")), b.prompt_builder(ids=ids), CatalogTrie(ids), users


def test_rank_users_shards_are_the_single_process_batches(bundle):
    """The union of the shards' rankings is the unsharded ranking, user for user."""
    model, builder, trie, users = _ranking_inputs(bundle)
    whole = rank_users(model, builder, trie, users, 5, batch_size=4, progress=False)
    parts = [rank_users(model, builder, trie, users, 5, batch_size=4, progress=False, shard=(r, 3))
             for r in range(3)]
    assert sum(len(p) for p in parts) == len(whole) == len(users)
    merged = {u: items for p in parts for u, items in p.items()}
    assert merged == whole


def test_evaluations_read_their_top_k_from_the_served_beam_width(bundle, tmp_path):
    """``rank_users`` at a beam width returns the first k of that wider search (what a server at that width
    returns); ``recsvc eval`` searches the bundle's served width (default 20), so a lone cutoff gives the same
    lists as the same cutoff read beside wider ones."""
    from recsvc.cli.main import main

    model, builder, trie, users = _ranking_inputs(bundle)
    wide = rank_users(model, builder, trie, users, 20, batch_size=4, progress=False)
    read = rank_users(model, builder, trie, users, 3, batch_size=4, progress=False, beam_width=20)
    assert read == {u: items[:3] for u, items in wide.items()}
    assert Bundle.open(bundle).served_beam_width() == 20  # no "beam_width" in bundle.json: the service's default
    runs = {}
    for ks in ("3", "3,20"):
        out = tmp_path / f"eval-{ks}.json"
        assert main(["eval", "--bundle", str(bundle), "--split", "test", "--k", ks, "--dtype", "fp32",
                     "--baselines", "none", "--no-fresh", "--json", str(out)]) == 0
        runs[ks] = json.loads(out.read_text())
    assert runs["3"]["beam_width"] == runs["3,20"]["beam_width"] == 20
    assert runs["3"]["model"]["recall@3"] == runs["3,20"]["model"]["recall@3"]
    assert runs["3"]["model"]["ndcg@3"] == runs["3,20"]["model"]["ndcg@3"]


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed beside the interpreter")
def test_torchrun_two_processes_equal_one(bundle, tmp_path, capsys):
    args = ["eval", "--bundle", str(bundle), "--split", "test", "--k", "1,5", "--dtype", "fp32",
            "--batch-size", "4"]
    one, one_s = _run([sys.executable, "-m", "recsvc.cli.main", *args, "--json", str(tmp_path / "a.json")])
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    two, two_s = _run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                       "--master_port", str(_free_port()), "-m", "recsvc.cli.main", *args,
                       "--json", str(tmp_path / "b.json")])
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert a["processes"] == 1 and b["processes"] == 2
    assert a["users"] == b["users"] > 8  # more than two batches of 4: both ranks ranked users
    assert _figures(a) == _figures(b)

    assert two.stdout.count("test: ") == 1 == one.stdout.count("test: ")  # rank 1 printed nothing
    with capsys.disabled():
        print(f"\n[eval tiny bundle: 1 process {one_s:.1f} s, torchrun 2 processes {two_s:.1f} s]")


VOLATILE = {"processes", "seconds", "ms_per_user", "fit_seconds", "rank_seconds", "wall_seconds"}  # timings, processes


def _figures(report):
    """The report without its timings, at any depth (e.g. each baseline's fit_seconds)."""
    if isinstance(report, dict):
        return {k: _figures(v) for k, v in report.items() if k not in VOLATILE}
    return report
