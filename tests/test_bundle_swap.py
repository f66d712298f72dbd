"""A new bundle version without downtime: `recsvc serve --bundle current` (a symlink to a version directory) as a
process on 127.0.0.1, histories in a real redis-server, tiny real bundles (``catalog_fixtures.live_bundle``: prior,
attributes, fresh items; the second version another random target). Under load (4 caller threads, each with one
request in flight at all times, bounded in count and time) the symlink flips: no call fails, the lists become the
new version's (checked against a direct decode with the new bundle, the live catalog carried over), and the p99
latency while the new version loads, warms and swaps stays within SWAP_P99_BOUND of the p99 before. A broken new version
(truncated weights) leaves the old one serving, with the reason logged and counted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from catalog_fixtures import DIM, NEW, add_entry, free_codes, live_bundle

from harness.processes import stop
from harness.serve_log import ServeLog
from recsvc.bundle.directory import Bundle
from recsvc.bundle.loading import save_causal_lm
from recsvc.bundle.presets import new_model
from recsvc.catalog.carry import carried_over
from recsvc.catalog.file import parse_catalog
from recsvc.client.client import RecClient
from recsvc.recommender.api import RecQuery
from recsvc.recommender.live_catalog import LiveRecommender
from recsvc.service.startup.settings import ServeSettings, build_recommender

REPO = Path(__file__).resolve().parents[1]
K = 5
USERS = [f"user{i}" for i in range(4)]
CALLERS = 4  # caller threads, one request in flight each
# p99 while a version loads, warms and swaps in, over p99 before: the goal, 2x. The loader yields to every call
# being answered (recsvc.service.swap.loader_throttle, call_activity) and the new version warms on the histories
# served lately; this test measured 1.09-1.16x (3 runs on a 2-core machine), `recsvc bench swap` on a Beauty
# bundle 0.98-1.11x (before those two changes: this test 0.89-1.81x, the Beauty bundle 2.19-2.40x)
SWAP_P99_BOUND = 2.0
MAX_CALLS = 4000  # per caller: the load is bounded in count ...
MAX_LOAD_S = 90.0  # ... and in time
FLAGS = ["--dtype", "fp32", "--spec", "off"]  # the engine flags of the server and of the direct decodes


@dataclass
class Served:
    proc: subprocess.Popen
    root: Path
    address: str = ""
    metrics_port: int = 0
    log: ServeLog | None = None  # its JSON log lines
    catalog: dict = field(default_factory=dict)  # the live-catalog document written
    serving: Path | None = None  # the version directory the server should be serving

    def flip(self, version: Path) -> float:
        """Points `current` at ``version`` atomically (as an operator does: ln -sfn + mv -T); returns when."""
        tmp = self.root / "current.tmp"
        if tmp.is_symlink():
            tmp.unlink()
        os.symlink(version, tmp)
        os.replace(tmp, self.root / "current")
        return time.monotonic()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()


def _version(src: Path, dst: Path, seed: int) -> Path:
    """A copy of bundle ``src`` with another random target (the same ids, tokenizer, prior, items)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "calibration.json"))
    bundle = Bundle.open(dst)
    save_causal_lm(new_model("tiny", bundle.load_tokenizer(), seed=seed), bundle.target_dir)
    return dst


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from harness.redis_server import RedisProcess

    root = tmp_path_factory.mktemp("swap")
    v1 = live_bundle(root / "build", n_users=40)
    versions = root / "versions"
    versions.mkdir()
    shutil.copytree(v1, versions / "v1", ignore=shutil.ignore_patterns("checkpoints"))
    _version(v1, versions / "v2", seed=7)
    broken = _version(v1, versions / "v3-broken", seed=8)
    weights = broken / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])  # a copy cut short
    os.symlink(versions / "v1", root / "current")
    (root / "redis").mkdir()
    redis = RedisProcess(data_dir=root / "redis")
    redis.start()
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--bundle", str(root / "current"), *FLAGS,
           "--port", "0", "--metrics-port", "0", "--threads", "1", "--redis-url", redis.url,
           "--catalog", str(root / "catalog_live.json"), "--bundle-watch-s", "0.2", "--grace-s", "1",
           "--max-wait-ms", "2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    s = Served(proc, root, serving=versions / "v1", log=ServeLog(proc).follow())
    try:
        _, line = s.log.event("serving")
        s.address, s.metrics_port = line["address"], line["metrics_port"]
        _, watching = s.log.event("bundle_watching")
        assert watching["serving"] == str(versions / "v1")
        ids = Bundle.open(versions / "v1").load_ids()
        with RecClient(s.address) as client:  # the users' histories, in Redis
            for n, user in enumerate(USERS):
                client.record(user, ids.item_ids[3 * n : 3 * n + 6].tolist())
        # the live catalog at run time: one item added, one retired
        s.catalog = {"version": 1, "add": [add_entry(NEW, free_codes(ids, 1, seed=3)[0], [0.2] * DIM)],
                     "retire": [int(ids.item_ids[10])]}
        (root / "catalog_live.json").write_text(json.dumps(s.catalog))
        s.log.event("catalog_updated")
        yield s
    finally:
        stop(proc)
        redis.close()


def direct_lists(version: Path, catalog: dict, histories: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each user's plain top-K decoded directly with ``version`` as the server builds it (the same factory and
    flags), over the same live catalog."""
    base = build_recommender(ServeSettings.for_bundle(str(version), FLAGS), step=lambda *a, **f: None)
    live = LiveRecommender(base)
    doc = parse_catalog(catalog, base.ids, live.vector_dim)
    live.apply(carried_over(doc, base.ids, live.vector_dim)[0])
    out = live.recommend([RecQuery(history=histories[u], k=K, mode="plain") for u in USERS])
    return {u: r.item_ids for u, r in zip(USERS, out, strict=True)}


@dataclass
class Call:
    user: str
    began: float
    took_s: float
    items: list[int]


def run_load(s: Served, during) -> tuple[list[Call], list[BaseException], object]:
    """CALLERS threads, each calling Recommend (the user's stored history) back to back until ``during()``
    returns, MAX_CALLS calls or MAX_LOAD_S; returns (calls, errors, what ``during`` returned)."""
    calls: list[Call] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    lock = threading.Lock()

    def caller(user: str) -> None:
        with RecClient(s.address, timeout_s=30) as client:
            for _ in range(MAX_CALLS):
                if stop.is_set():
                    return
                began = time.monotonic()
                try:
                    out = client.recommend(user, k=K, mode="plain")
                except BaseException as exc:  # noqa: BLE001 (reported by the test)
                    with lock:
                        errors.append(exc)
                    continue
                with lock:
                    calls.append(Call(user, began, time.monotonic() - began, [i.item_id for i in out.items]))

    threads = [threading.Thread(target=caller, args=(USERS[i % len(USERS)],)) for i in range(CALLERS)]
    for t in threads:
        t.start()
    timer = threading.Timer(MAX_LOAD_S, stop.set)
    timer.start()
    try:
        result = during()
    finally:
        stop.set()
        timer.cancel()
        for t in threads:
            t.join(60)
    return calls, errors, result


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def stored_histories(s: Served) -> dict[str, list[int]]:
    with RecClient(s.address) as client:
        return {u: list(client.history(u)) for u in USERS}


def test_a_new_version_swaps_in_under_load_without_a_failed_call(served) -> None:
    s = served
    v1, v2 = s.root / "versions" / "v1", s.root / "versions" / "v2"
    histories = stored_histories(s)
    before_lists, after_lists = direct_lists(v1, s.catalog, histories), direct_lists(v2, s.catalog, histories)
    assert before_lists != after_lists  # another model: the test can tell them apart
    mark = len(s.log.events)
    window: dict[str, float] = {}

    def during() -> None:
        time.sleep(4.0)  # before the swap
        window["flip"] = s.flip(v2)
        window["swapped"], window["line"] = s.log.event("bundle_swapped", after=mark, timeout_s=60)
        time.sleep(3.0)  # after it

    calls, errors, _ = run_load(s, during)
    s.serving = v2
    assert not errors, errors[:3]
    before = [c for c in calls if c.began + c.took_s < window["flip"]]
    swapping = [c for c in calls if window["flip"] <= c.began <= window["swapped"] + 0.5]
    after = [c for c in calls if c.began > window["swapped"]]
    assert len(before) >= 100 and swapping and len(after) >= 20
    assert all(c.items == before_lists[c.user] for c in before)
    assert all(c.items == after_lists[c.user] for c in after)  # the new version's lists, the catalog carried
    p99_before, p99_swap = p99([c.took_s for c in before]), p99([c.took_s for c in swapping])
    print(f"swap under load: {len(calls)} calls, 0 failed; p99 before {p99_before * 1e3:.1f} ms "
          f"({len(before)} calls), during the swap {p99_swap * 1e3:.1f} ms ({len(swapping)} calls, "
          f"{window['swapped'] - window['flip']:.2f} s); swap {window['line']['seconds']} s")
    assert p99_swap <= SWAP_P99_BOUND * p99_before
    line = window["line"]
    assert line["bundle"] == str(v2) and line["previous"] == str(s.root / "versions" / "v1")
    assert line["catalog_added"] == 1 and line["catalog_retired"] == 1
    # the new version warmed on the histories served lately: the callers' next requests find its states warm
    assert line["warmed_histories"] >= len({tuple(h) for h in histories.values()})
    retired = s.catalog["retire"][0]
    assert all(retired not in c.items for c in calls)
    with RecClient(s.address) as client:  # the added item is still known to the new version
        client.recommend("someone", history=[NEW, 1, 2], k=K, mode="plain")
    metrics = s.metrics()
    assert 'recsvc_bundle_swaps_total{outcome="applied"} 1.0' in metrics
    assert f'recsvc_bundle_serving_info{{bundle="{v2}"}} 1.0' in metrics


def test_a_broken_version_leaves_the_old_one_serving(served) -> None:
    s = served
    serving = s.serving
    histories = stored_histories(s)
    expected = direct_lists(serving, s.catalog, histories)
    mark = len(s.log.events)
    rejected_line: dict = {}

    def during() -> None:
        time.sleep(1.0)
        s.flip(s.root / "versions" / "v3-broken")
        rejected_line.update(s.log.event("bundle_swap_rejected", after=mark, timeout_s=60)[1])
        time.sleep(1.5)

    calls, errors, _ = run_load(s, during)
    assert not errors, errors[:3]
    assert calls and all(c.items == expected[c.user] for c in calls)  # the old version kept serving throughout
    assert rejected_line["bundle"] == str(s.root / "versions" / "v3-broken")
    assert rejected_line["serving"] == str(serving) and rejected_line["level"] == "warning"
    assert rejected_line["reason"]
    print(f"broken version rejected: {rejected_line['reason']}")
    assert not any(e.get("event") == "bundle_swapped" for _, e in s.log.events[mark:])
    metrics = s.metrics()
    assert 'recsvc_bundle_swaps_total{outcome="rejected"} 1.0' in metrics
    assert f'recsvc_bundle_serving_info{{bundle="{serving}"}} 1.0' in metrics
    s.flip(serving)  # back: the served version again, nothing to load


def test_sighup_reloads_the_served_version(served) -> None:
    """The same directory again (changed in place, e.g. re-tuned): SIGHUP loads it beside itself and swaps."""
    import signal

    s = served
    mark = len(s.log.events)
    s.proc.send_signal(signal.SIGHUP)
    _, line = s.log.event("bundle_swapped", after=mark, timeout_s=60)
    assert line["bundle"] == line["previous"] == str(s.serving)
    assert line["catalog_added"] == 1 and line["catalog_retired"] == 1  # the live catalog carried over again
    with RecClient(s.address) as client:
        assert len(client.recommend(USERS[0], k=K, mode="plain").items) == K
