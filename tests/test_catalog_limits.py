"""The live-catalog file's size limit and its reading off the serving process: a file over the limit is rejected
unread with a reason naming the limit (the reader, the watch of a running gRPC server, `recsvc catalog`); a file
within it is read and validated by a child process with the same results and messages as an in-process read,
and while it parses the serving process keeps running Python (an in-thread parse does not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from catalog_fixtures import NEW, add_entry, free_codes, live_bundle, vector_of
from cli_commands import only_commands
from test_train_fixtures import one_thread, random_ids  # noqa: F401 (one_thread: a fixture)

import recsvc.cli.main as cli
from bench.catalog import catalog_document, write_catalog
from recsvc.catalog.file import MAX_MB_ENV, check_size, read_catalog
from recsvc.catalog.reader import read_catalog_isolated
from recsvc.client.client import RecClient
from recsvc.errors import UserError
from recsvc.recommender.bundle_recommender import BundleRecommender
from recsvc.service.swap.catalog_watch import watch_catalog

BASE = random_ids(list(range(1, 61)))


def test_a_file_over_the_limit_is_rejected_unread_with_the_limit_named(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "catalog_live.json"
    path.write_text("{" + " " * 5000)  # not JSON: a reader that parsed it would say so
    for read in (read_catalog, read_catalog_isolated):
        with pytest.raises(UserError, match=r"\(5,001 bytes\) is over the live-catalog size limit of 0\.004 MB"):
            read(path, BASE, None, 4000)
    monkeypatch.setenv(MAX_MB_ENV, "0.001")  # the default limit comes from the environment
    with pytest.raises(UserError, match="size limit of 0.001 MB"):
        check_size(path)
    monkeypatch.setenv(MAX_MB_ENV, "lots")
    with pytest.raises(UserError, match="RECSVC_CATALOG_MAX_MB='lots' is not a number"):
        check_size(path)
    monkeypatch.delenv(MAX_MB_ENV)
    with pytest.raises(UserError, match="not a readable JSON file"):  # within the default limit: parsed
        read_catalog_isolated(path, BASE)


def test_the_child_reads_what_an_in_process_read_reads(tmp_path: Path) -> None:
    doc = catalog_document(BASE, 50, 16, seed=3)
    doc["retire"] = [5, doc["add"][0]["item_id"]]
    path = tmp_path / "c.json"
    write_catalog(doc, BASE, path, 16)
    here, there = read_catalog(path, BASE, 16), read_catalog_isolated(path, BASE, 16)
    assert here.version == there.version == 1
    for field in ("item_ids", "codes", "vectors", "retired"):
        a, b = getattr(here, field), getattr(there, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field
    # a bad document: the same message either way, naming the field
    doc["add"][3]["codes"] = [int(c) for c in BASE.codes[7]]
    path.write_text(json.dumps(doc))
    messages = []
    for read in (read_catalog, read_catalog_isolated):
        with pytest.raises(UserError) as err:
            read(path, BASE, 16)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "add[3].codes" in messages[0] and "is already item" in messages[0]


def _longest_pause(work) -> tuple[float, float]:
    """Runs ``work`` in a thread while this thread ticks every millisecond: (the longest gap between two ticks,
    seconds ``work`` took). A thread holding the GIL shows as a long gap."""
    done = threading.Event()
    took = [0.0]

    def run() -> None:
        began = time.perf_counter()
        try:
            work()
        finally:
            took[0] = time.perf_counter() - began
            done.set()

    thread = threading.Thread(target=run)
    last, longest = time.perf_counter(), 0.0
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    return longest, took[0]


def test_reading_in_the_child_leaves_the_serving_process_running(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    size = write_catalog(catalog_document(BASE, 2500, 384, seed=1), BASE, path, 384)
    assert size > 15_000_000
    in_thread, parse_s = _longest_pause(lambda: read_catalog(path, BASE, 384, 10**9))
    in_child, child_s = _longest_pause(lambda: read_catalog_isolated(path, BASE, 384, 10**9))
    # an in-thread read stops this thread for most of its parse; the child's leaves it ticking
    assert in_thread > 0.15, (in_thread, parse_s)
    assert in_child < in_thread / 2, (in_child, in_thread, child_s)


# --- a running server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return live_bundle(tmp_path_factory.mktemp("live-limits"))


def test_a_running_server_rejects_an_oversized_file_and_keeps_serving(bundle, make_server, tmp_path,
                                                                        one_thread) -> None:  # noqa: F811
    base = BundleRecommender.from_bundle(bundle, dtype="fp32")
    path = tmp_path / "catalog_live.json"
    entry = add_entry(NEW, free_codes(base.ids, 1)[0], vector_of(bundle, 1))
    small = json.dumps({"version": 1, "add": [entry], "retire": []})
    path.write_text(small)
    live, watch = watch_catalog(base, path, check_every_s=0.05, max_bytes=len(small) + 100)
    server = make_server(live, default_mode="plain")
    server.metrics.registry.register(watch)
    try:
        assert live.state.catalog.version == 1 and watch.applied == 1
        big = {"version": 2, "add": [entry], "retire": [], "pad": "x" * 200}  # over the limit (and malformed)
        tmp = path.with_name("next.json")
        tmp.write_text(json.dumps(big))
        os.replace(tmp, path)
        deadline = time.monotonic() + 10
        while watch.rejected == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "over the live-catalog size limit" in watch.last_reason and "MB" in watch.last_reason
        assert live.state.catalog.version == 1  # the previous catalog keeps serving
        assert server.metrics.registry.get_sample_value("recsvc_catalog_updates_total",
                                                        {"outcome": "rejected"}) == 1
        with RecClient(server.address) as client:
            assert client.recommend("u", history=[NEW, 1], k=5).items
    finally:
        watch.close()


def test_recsvc_catalog_commands_read_with_the_limit(bundle, tmp_path, monkeypatch, capsys) -> None:
    only_commands(monkeypatch, "catalog")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"version": 1, "add": [], "retire": [1]}) + " " * 3000)
    monkeypatch.setenv(MAX_MB_ENV, "0.002")
    assert cli.main(["catalog", "show", "--bundle", str(bundle), "--catalog", str(path)]) == 2
    assert "size limit of 0.002 MB" in capsys.readouterr().err
    monkeypatch.delenv(MAX_MB_ENV)
    assert cli.main(["catalog", "show", "--bundle", str(bundle), "--catalog", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["retired"] == [1]


def test_bench_catalog_reports_each_phase_with_its_outcome(bundle, tmp_path, monkeypatch, capsys) -> None:
    """`recsvc bench catalog`, small: a file over a small limit is rejected with the reason, the same file under
    a raised limit is applied by the child reader, each phase's latencies are measured against the baseline."""
    only_commands(monkeypatch, "bench")
    out = tmp_path / "catalog.json"
    assert cli.main(["bench", "catalog", "--bundle", str(bundle), "--items", "300", "--dim", "8", "--seconds", "1",
                     "--after-s", "0.2", "--users", "20", "--max-mb", "0.02", "--accept-mb", "10", "--callers", "2",
                     "--workdir", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "| over_limit |" in capsys.readouterr().out
    phases = {p["phase"]: p for p in report["phases"]}
    assert list(phases) == ["baseline", "over_limit", "accepted_process"]
    assert phases["baseline"]["calls"] > 0 and phases["baseline"]["errors"] == 0
    over = phases["over_limit"]
    assert over["outcome"] == "rejected" and "over the live-catalog size limit of 0.02 MB" in over["reason"]
    accepted = phases["accepted_process"]
    assert accepted["outcome"] == "applied" and accepted["read_in"] == "another process"
    assert accepted["errors"] == 0 and accepted["read_s"] > 0 and accepted["build_s"] >= 0
    assert report["file_mb"] > 0.02 and report["precision"] in ("fp32", "bf16")
    assert all("within_budget" in p for p in report["phases"][1:])


def test_recsvc_serve_does_not_start_on_an_oversized_file(bundle, tmp_path) -> None:
    """`recsvc serve --catalog-max-mb`: a file over the limit at start-up stops the start (exit 2, the limit
    named), as a malformed one does: a server never comes up without the operator's retirements."""
    catalog = tmp_path / "live.json"
    catalog.write_text(json.dumps({"version": 1, "add": [], "retire": [1]}) + " " * 2000)
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--bundle", str(bundle), "--dtype", "fp32", "--port",
           "0", "--spec", "off", "--catalog", str(catalog), "--catalog-max-mb", "0.001", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: " in done.stderr and "over the live-catalog size limit of 0.001 MB" in done.stderr
    assert "Traceback" not in done.stderr
