"""The daily refresh (``recsvc refresh run``): yesterday's items bundle + the day's log by the team's keys ->
today's bundle, its models continued from yesterday's, gated, published by flipping the served symlink.

Tiny real bundles: the synthetic split, random ids, an item-level target trained a few epochs by
``recsvc train items --bundle`` (so that the day is readable: validation NDCG@10 well above chance) and a
transition prior mixed with a tiny SASRec. The day is the split's test period as a CSV (a user the split never
saw, a key the catalog lacks); the corrupted day is the same rows with their item keys shuffled. End to end: a
real ``recsvc serve --bundle current`` on 127.0.0.1 with Redis under load while a good refresh is published (0
failed calls, the new version swapped in) and a corrupted one is kept aside (the server keeps serving)."""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from catalog_fixtures import add_entry, free_codes
from test_timeline_serving import make_items_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from harness.processes import stop
from harness.serve_log import ServeLog
from recsvc.bundle.directory import Bundle
from recsvc.bundle.keys import read_item_keys
from recsvc.client.client import RecClient
from recsvc.content.fresh import FreshItems, FreshSettings, ItemVectors
from recsvc.data.split import load_split_dir
from recsvc.priors.mixed import MixedPrior, MixSettings, SequenceModel
from recsvc.priors.transition import PriorSettings, TransitionPrior
from recsvc.timeline.model import TimelineModel
from training.refresh.day_log import read_day_log
from training.refresh.gate import GateFigures, GateRule, decide
from training.refresh.merge import USERS_FILE, merge_day, read_user_keys
from training.refresh.run import KEPT_ASIDE

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]
START = 1_767_225_600
PLAN = ["--epochs", "2", "--bf16", "off", "--threads", "1", "--tolerance", "0.2"]


def trained_items_bundle(root: Path) -> Path:
    """make_items_bundle's split and ids, its target trained 6 epochs (deploy protocol), a mixed prior."""
    from recsvc.priors.sasrec import SASRec
    from training.baselines.sasrec import SASRecBaseline
    from training.baselines.sasrec_train import SASRecSettings

    path = make_items_bundle(root, n_users=120)
    assert cli.main(["train", "items", "--bundle", str(path), "--epochs", "6", "--hidden", "32", "--max-items", "8",
                     "--batch-size", "16", "--patience", "0", "--bf16", "off", "--threads", "1"]) == 0
    bundle = Bundle.open(path)
    data = load_split_dir(bundle.resolve_data_dir())
    items = bundle.load_ids().item_ids.tolist()
    transition = TransitionPrior.fit(data.sequences("train+valid").values(), items, PriorSettings(weight=0.3),
                                     fitted_on="train+valid")
    torch.manual_seed(0)
    arch = SASRecSettings(hidden=8, blocks=1, heads=1, max_len=10)
    seq = SASRecBaseline(SASRec(len(items), hidden=8, blocks=1, heads=1, max_len=10), torch.tensor(items),
                         torch.ones(len(items)), arch).save(root / "sasrec")
    MixedPrior(transition, SequenceModel.load(seq), MixSettings(0.3, 1.0)).save(bundle.prior_dir, seq)
    shutil.copytree(seq, bundle.prior_dir / "sequence-train")
    vectors = ItemVectors.from_arrays(items, np.random.default_rng(0).normal(size=(len(items), 8)))
    FreshItems(vectors, [], FreshSettings(slots=1, window=1, min_similarity=0.9), "train+valid").save(
        bundle.fresh_dir)
    return path


def write_day(data, path: Path, shuffle: bool = False, extra: list[list] | None = None) -> Path:
    """The split's test period as a day's log by keys (+ ``extra`` rows); ``shuffle``: item keys shuffled."""
    rows = [[str(u), data.items[i].asin, START + 60 * j + u] for u, items in sorted(data.test.items())
            for j, i in enumerate(items)]
    rows += extra or []
    if shuffle:
        keys = [r[1] for r in rows]
        random.Random(0).shuffle(keys)
        rows = [[r[0], k, r[2]] for r, k in zip(rows, keys, strict=True)]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user_id", "item_id", "timestamp"])
        w.writerows(rows)
    return path


@pytest.fixture(scope="module")
def yesterday(tmp_path_factory) -> Path:
    return trained_items_bundle(tmp_path_factory.mktemp("refresh"))


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------- the gate's rule
@pytest.mark.parametrize("figures, publish, says", [
    (GateFigures(500, 0.20, 0.21, 0.95, 0.85, 1.06, 0.22), True, "0.950x"),
    (GateFigures(500, 0.10, 0.21, 0.48, 0.40, 0.57, 0.22), False, "worse than yesterday"),
    (GateFigures(500, 0.20, 0.01, 20.0, 9.0, 40.0, 0.22), False, "do not follow the catalog"),
    (GateFigures(500, 0.20, 0.01, 20.0, 9.0, 40.0, None), True, "20.000x"),  # no reference: check 1 skipped
    (GateFigures(0, 0.0, 0.0, None, None, None, 0.22), False, "no user of the day"),
])
def test_the_gate_reads_its_figures(figures, publish, says) -> None:
    decision = decide(figures)
    assert decision.publish is publish and says in decision.reason


def test_the_tolerance_lets_a_slightly_worse_bundle_through() -> None:
    f = GateFigures(500, 0.19, 0.21, 0.90, 0.84, 0.96, 0.22)
    assert not decide(f).publish and decide(f, GateRule(tolerance=0.05)).publish


# ---------------------------------------------------------------------------------------------- today's split
def test_the_day_joins_each_users_history_and_its_last_item_is_kept_aside(yesterday, tmp_path) -> None:
    data = load_split_dir(Bundle.open(yesterday).resolve_data_dir())
    keys = {m.asin: i for i, m in data.items.items()}
    u = sorted(data.train)[0]
    known = data.train[u][0]  # already in u's history: a repeat, dropped
    fresh = [i for i in sorted(data.items) if i not in data.train[u] + data.valid[u]][:2]
    log = tmp_path / "day.csv"
    with log.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user_id", "item_id", "timestamp"])
        w.writerows([[str(u), data.items[fresh[1]].asin, START + 10], [str(u), data.items[fresh[0]].asin, START],
                     [str(u), data.items[known].asin, START + 5], ["stranger", data.items[fresh[0]].asin, START],
                     ["stranger", "NO-SUCH-KEY", START]])
    day = read_day_log(log, set(keys))
    assert day.unknown_item_rows == 1 and len(day.events) == 4
    merged = merge_day(data, read_user_keys(data.root, data), keys, day, data.items, tmp_path / "today")
    today = load_split_dir(merged.data_dir)
    assert today.train[u] == data.train[u] + data.valid[u] + [fresh[0]]  # in time order, the last kept aside
    assert today.valid[u] == [fresh[1]]
    assert (merged.added, merged.day_users, merged.new_users, merged.held_out, merged.repeats) == (3, 2, 1, 1, 1)
    users = json.loads((merged.data_dir / USERS_FILE).read_text())
    stranger = users["stranger"]
    assert stranger == max(data.train) + 1 and today.train[stranger] == [fresh[0]] and today.valid[stranger] == []
    assert today.test == {**{v: data.test.get(v, []) for v in data.train}, stranger: []}
    assert read_user_keys(merged.data_dir, today) == users


# ---------------------------------------------------------------------------------------------- the command
def test_a_good_day_is_published_and_recorded(yesterday, tmp_path, capsys) -> None:
    root = tmp_path
    os.symlink(yesterday, root / "current")
    data = load_split_dir(Bundle.open(yesterday).resolve_data_dir())
    first = sorted(data.items)[:2]
    log = write_day(data, root / "day.csv", extra=[["newbie", data.items[first[0]].asin, START],
                                                    ["newbie", data.items[first[1]].asin, START + 60],
                                                    ["newbie", "NO-SUCH-KEY", START + 90]])
    code, out, _ = run(["refresh", "run", "--bundle", str(root / "current"), "--log", str(log), "--out",
                        str(root / "v1"), "--publish", str(root / "current"), *PLAN], capsys)
    line = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and line["event"] == "refresh" and line["passed"] and line["target_epochs"] == 2
    assert (root / "current").resolve() == (root / "v1").resolve()
    record = Bundle.open(root / "v1").read()["refresh"]
    assert record["day"]["unknown_item_rows"] == 1 and record["data"]["new_users"] == 1
    assert record["data"]["added"] == sum(map(len, data.test.values())) + 2
    assert record["gate"]["users"] == record["data"]["held_out"] > 0 and record["gate"]["reference"] > 0.2
    assert record["published"] == str(root / "current") and set(record["seconds"]) >= {"target", "gate", "total"}
    # the models continued from yesterday's: the target's weights moved, the SASRec too; the served prior counted
    # over today's history
    old, new = TimelineModel.load(Bundle.open(yesterday).target_dir), TimelineModel.load(root / "v1" / "target")
    assert any(not torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values(),
                                                      strict=True))
    assert json.loads((root / "v1" / "target" / "training.json").read_text())["train"]["init"] == str(
        (Bundle.open(yesterday).target_dir).resolve())
    prior = TransitionPrior.load(root / "v1" / "prior")
    assert prior.fitted_on == "train+valid" and prior.settings == TransitionPrior.load(
        Bundle.open(yesterday).prior_dir).settings
    assert (root / "v1" / "prior" / "sequence" / "mix.json").is_file()
    assert Bundle.open(root / "v1").read()["refreshes"][-1]["added"] == record["data"]["added"]


def test_shuffled_item_ids_are_kept_aside_with_the_reason(yesterday, tmp_path, capsys) -> None:
    os.symlink(yesterday, tmp_path / "current")
    data = load_split_dir(Bundle.open(yesterday).resolve_data_dir())
    log = write_day(data, tmp_path / "day.csv", shuffle=True)
    code, out, err = run(["refresh", "run", "--bundle", str(tmp_path / "current"), "--log", str(log), "--out",
                          str(tmp_path / "v1"), "--publish", str(tmp_path / "current"), *PLAN], capsys)
    assert code == KEPT_ASIDE and "kept aside" in err and "shuffled" in err
    assert (tmp_path / "current").resolve() == yesterday.resolve()
    record = Bundle.open(tmp_path / "v1").read()["refresh"]
    assert not record["passed"] and record["published"] is None and "shuffled" in record["reason"]
    assert record["target"] is None and record["gate"]["today"] is None  # refused before anything was trained
    assert not (tmp_path / "v1" / "target").exists()


def test_items_added_to_the_live_catalog_join_todays_catalog(yesterday, tmp_path, capsys) -> None:
    src = tmp_path / "y"
    shutil.copytree(yesterday, src)
    ids = Bundle.open(src).load_ids()
    new = int(ids.item_ids.max()) + 1
    entry = {**add_entry(new, free_codes(ids, 1, seed=3)[0], [0.1] * 8), "key": "LAUNCH-1"}
    (src / "catalog_live.json").write_text(json.dumps({"version": 1, "add": [entry], "retire": []}))
    data = load_split_dir(Bundle.open(src).resolve_data_dir())
    u = sorted(data.test)[0]
    log = write_day(data, tmp_path / "day.csv", extra=[[str(u), "LAUNCH-1", START + 10 ** 6]])
    code, out, _ = run(["refresh", "run", "--bundle", str(src), "--log", str(log), "--out", str(tmp_path / "v1"),
                        *PLAN], capsys)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["new_items"] == 1
    today = Bundle.open(tmp_path / "v1")
    assert new in today.load_ids() and today.load_ids().codes[today.load_ids().index_of(new)].tolist() == \
        entry["codes"]
    assert read_item_keys(today.root).item_of("LAUNCH-1") == new
    split = load_split_dir(today.resolve_data_dir())
    assert new in split.train[u] + split.valid[u]
    fresh = FreshItems.load(today.fresh_dir)  # its vector joins the fresh component's; it is not fresh any more
    assert new in fresh.vectors.item_ids and new not in fresh.fresh_ids
    seen = {i for seq in split.sequences("train+valid").values() for i in seq}
    assert set(fresh.fresh_ids.tolist()) == set(today.load_ids().item_ids.tolist()) - seen


def test_mistakes_are_exit_2_with_a_message(yesterday, tmp_path, capsys) -> None:
    data = load_split_dir(Bundle.open(yesterday).resolve_data_dir())
    log = write_day(data, tmp_path / "day.csv")
    cases = [
        (["--log", str(tmp_path / "missing.csv")], "not found"),
        (["--epochs", "0"], "--epochs"),
        (["--out", str(yesterday)], "yesterday's bundle"),
    ]
    for extra, says in cases:
        argv = ["refresh", "run", "--bundle", str(yesterday), "--log", str(log), "--out", str(tmp_path / "o"), *PLAN]
        for flag, value in zip(extra[::2], extra[1::2], strict=True):
            argv[argv.index(flag) + 1] = value
        code, _, err = run(argv, capsys)
        assert code == 2 and says in err and "Traceback" not in err
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("user_id,item_id,timestamp\n1,NOPE,1767225600\n")
    code, _, err = run(["refresh", "run", "--bundle", str(yesterday), "--log", str(unknown), "--out",
                        str(tmp_path / "o2"), *PLAN], capsys)
    assert code == 2 and "no interaction with a catalog item" in err


# ---------------------------------------------------------------------------------------------- under load
def test_refreshes_swap_under_load_and_a_corrupted_one_does_not(yesterday, tmp_path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from harness.redis_server import RedisProcess

    versions = tmp_path / "versions"
    shutil.copytree(yesterday, versions / "v0")
    current = tmp_path / "current"
    os.symlink(versions / "v0", current)
    data = load_split_dir(Bundle.open(versions / "v0").resolve_data_dir())
    good, bad = write_day(data, tmp_path / "good.csv"), write_day(data, tmp_path / "bad.csv", shuffle=True)
    (tmp_path / "redis").mkdir()
    redis = RedisProcess(data_dir=tmp_path / "redis")
    redis.start()
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--bundle", str(current), "--dtype", "fp32", "--port",
           "0", "--metrics-port", "0", "--threads", "1", "--redis-url", redis.url, "--bundle-watch-s", "0.2",
           "--grace-s", "1", "--max-wait-ms", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log = ServeLog(proc).follow()
    try:
        _, line = log.event("serving")
        address = line["address"]
        users = [f"user{i}" for i in range(4)]
        items = sorted(data.items)
        with RecClient(address) as client:
            for n, user in enumerate(users):
                client.record(user, items[3 * n : 3 * n + 5])
        calls, errors = [], []
        done = threading.Event()

        def caller(user: str) -> None:
            with RecClient(address, timeout_s=30) as client:
                for _ in range(4000):  # bounded in count, and by the refreshes' time
                    if done.is_set():
                        return
                    try:
                        calls.append(len(client.recommend(user, k=5, mode="plain").items))
                    except BaseException as exc:  # noqa: BLE001 (asserted below)
                        errors.append(exc)

        threads = [threading.Thread(target=caller, args=(u,)) for u in users]
        for t in threads:
            t.start()
        try:
            argv = ["refresh", "run", "--bundle", str(current), "--publish", str(current), *PLAN]
            assert cli.main([*argv, "--log", str(good), "--out", str(versions / "v1")]) == 0
            _, swapped = log.event("bundle_swapped", timeout_s=60)
            n_swapped = len(calls)
            assert cli.main([*argv, "--log", str(bad), "--out", str(versions / "v2")]) == KEPT_ASIDE
            time.sleep(1.0)  # the watch would have seen a flip by now
            assert len(calls) > n_swapped
        finally:
            done.set()
            for t in threads:
                t.join(60)
        assert not errors and len(calls) > 20 and all(n == 5 for n in calls)
        assert current.resolve() == (versions / "v1").resolve()
        assert str(versions / "v1") in json.dumps(swapped)
        assert not [line for _, line in log.events if line.get("event") == "bundle_swapped"
                    and str(versions / "v2") in json.dumps(line)]
    finally:
        stop(proc)
        redis.close()
