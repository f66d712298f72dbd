"""A deployed bundle does not depend on where it was built: serving reads BUNDLE/popularity.json and
BUNDLE/calibration_histories.json (``recsvc.bundle.serving_files``) and never opens the training data directory
recorded in bundle.json; a bundle made before those files existed still serves, with one warning.

Served by a real gRPC server on localhost. Tests run as root, where ``chmod 000`` does not stop a read: the
recorded data directory's files here are links to ``/proc/self/mem``, a file that exists and whose read fails
(EIO) for root too, and an audit hook records every open / listing of a path under that directory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle

from recsvc.bundle.directory import Bundle
from recsvc.bundle.serving_files import (
    CALIBRATION_FILE,
    POPULARITY_FILE,
    count_popularity,
    read_calibration_histories,
    read_popularity,
)
from recsvc.client.client import RecClient
from recsvc.data.split import load_split_dir
from recsvc.service.startup.settings import ServeSettings, build_recommender

_WATCHED: list[str] = []  # path prefixes whose opens the audit hook records (the hook cannot be removed)
_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if _WATCHED and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | Path):
        path = os.path.abspath(str(args[0]))
        if any(path.startswith(w) for w in _WATCHED):
            _OPENED.append(f"{event} {path}")


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("selfcontained"), n_users=60)


def _copy(bundle: Path, dst: Path, data: Path) -> Path:
    """A copy of ``bundle`` recording ``data`` as its data directory."""
    shutil.copytree(bundle, dst, ignore=shutil.ignore_patterns("checkpoints", "calibration.json"))
    meta = json.loads((dst / "bundle.json").read_text())
    meta["data"] = str(data)
    (dst / "bundle.json").write_text(json.dumps(meta))
    return dst


def _unreadable_data(where: Path) -> Path:
    """A data directory whose files exist and cannot be read, by root too."""
    where.mkdir()
    for name in ("sequential_train.txt", "sequential_valid.txt", "sequential_test.txt", "items.json"):
        os.symlink("/proc/self/mem", where / name)
    with pytest.raises(OSError):
        (where / "sequential_train.txt").read_text()
    return where


def _serve(bundle: Path, make_server, flags: list[str]):
    steps: list[tuple[str, int, dict]] = []
    rec = build_recommender(ServeSettings.for_bundle(str(bundle), flags),
                            step=lambda event, level=logging.INFO, **f: steps.append((event, level, f)))
    return make_server(rec), rec, steps


def test_build_writes_what_serving_reads(built) -> None:
    data = load_split_dir(Bundle.open(built).resolve_data_dir())
    counts = read_popularity(built)
    assert counts == count_popularity(data) and sum(counts.values()) == sum(
        len(s) for period in (data.train, data.valid, data.test) for s in period.values())
    histories = read_calibration_histories(built)
    valid = {tuple(u.history[-50:]) for u in data.eval_users("valid")}
    assert histories and all(tuple(h) in valid for h in histories)


def test_a_bundle_whose_data_directory_is_unreadable_serves(built, tmp_path, make_server) -> None:
    data = _unreadable_data(tmp_path / "data")
    bundle = _copy(built, tmp_path / "bundle", data)
    _WATCHED.append(str(data))
    try:
        server, rec, steps = _serve(bundle, make_server, ["--spec", "auto", "--recalibrate",
                                                          "--startup-budget-s", "20"])
        with RecClient(f"127.0.0.1:{server.port}") as client:
            cold = client.recommend("new-user", k=5)
            client.record("u1", [1, 2, 3])
            warm = client.recommend("u1", k=5, mode="plain")
    finally:
        _WATCHED.remove(str(data))
    assert _OPENED == []  # the recorded data directory was never opened nor listed
    counts = read_popularity(bundle)
    by_count = sorted(counts, key=lambda i: (-counts[i], i))
    assert [i.item_id for i in cold.items] == by_count[:5]  # the bundle's popularity, not item-id order
    assert len(warm.items) == 5
    assert not [s for s in steps if s[0] == "bundle_without_serving_files"]
    calibrating = [f for e, _, f in steps if e == "calibrating"]
    assert calibrating and calibrating[0]["histories"].endswith("validation users")


def test_an_old_bundle_without_the_files_serves_with_one_warning(built, tmp_path, make_server) -> None:
    bundle = _copy(built, tmp_path / "old", tmp_path / "absent")
    for name in (POPULARITY_FILE, CALIBRATION_FILE):
        (bundle / name).unlink()
    server, rec, steps = _serve(bundle, make_server, ["--spec", "auto", "--recalibrate", "--startup-budget-s", "20"])
    with RecClient(f"127.0.0.1:{server.port}") as client:
        cold = client.recommend("new-user", k=5)
        warm = client.recommend("u1", history=[1, 2, 3], k=5, mode="plain")
    warnings = [(lvl, f) for e, lvl, f in steps if e == "bundle_without_serving_files"]
    assert len(warnings) == 1 and warnings[0][0] == logging.WARNING
    assert warnings[0][1]["missing"] == [POPULARITY_FILE, CALIBRATION_FILE] and warnings[0][1]["reason"]
    ids = sorted(Bundle.open(bundle).load_ids().item_ids.tolist())
    assert [i.item_id for i in cold.items] == ids[:5]  # item-id order
    assert len(warm.items) == 5
    assert [f for e, _, f in steps if e == "calibrating"][0]["histories"] == "popular items"


def test_serving_files_command_adds_them_to_an_old_bundle(built, tmp_path) -> None:
    from recsvc.cli.main import main

    bundle = _copy(built, tmp_path / "old", Bundle.open(built).resolve_data_dir())
    for name in (POPULARITY_FILE, CALIBRATION_FILE):
        (bundle / name).unlink()
    assert main(["bundle", "serving-files", "--bundle", str(bundle)]) == 0
    assert read_popularity(bundle) == read_popularity(built)
    assert read_calibration_histories(bundle) == read_calibration_histories(built)
    assert main(["bundle", "serving-files", "--bundle", str(bundle), "--data", str(tmp_path / "nowhere")]) == 2
