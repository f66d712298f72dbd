"""The live catalog on a running gRPC server (127.0.0.1, a tiny real bundle): added items reach responses within
seconds, retired items never return, malformed files are rejected with a log line while the old catalog keeps
serving identical responses, swaps under load fail no request; and `recsvc serve` itself follows the file."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from catalog_fixtures import DIM, NEW, add_entry, free_codes, live_bundle, vector_of
from cli_commands import only_commands
from service_helpers import json_line
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from harness.processes import stop
from recsvc.client.client import RecClient
from recsvc.errors import UserError
from recsvc.recommender.bundle_recommender import BundleRecommender
from recsvc.service.swap.catalog_watch import watch_catalog

REPO = Path(__file__).resolve().parents[1]
K = 5
WATCH_LOG = "recsvc.service.swap.catalog_watch"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return live_bundle(tmp_path_factory.mktemp("live-served"), mixed=True)  # the recipe's prior: mixed with SASRec


@pytest.fixture(scope="module")
def base(bundle, one_thread) -> BundleRecommender:  # noqa: F811
    return BundleRecommender.from_bundle(bundle, dtype="fp32")


@pytest.fixture
def served(base, make_server, tmp_path):
    """(server, live recommender, watch, catalog file): a real server over the bundle's recommender, watching a
    catalog file that does not exist yet (checked every 50 ms)."""
    path = tmp_path / "catalog_live.json"
    live, watch = watch_catalog(base, path, check_every_s=0.05)
    server = make_server(live)
    server.metrics.registry.register(watch)
    yield server, live, watch, path
    watch.close()


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time limit"
        time.sleep(0.05)


def write(path: Path, document: dict | str) -> None:
    """An operator's write (atomic, as `recsvc catalog` does it); a str is written as is."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(document if isinstance(document, str) else json.dumps(document))
    os.replace(tmp, path)


def items(response) -> list[int]:
    return [i.item_id for i in response.items]


def test_an_added_item_reaches_a_running_server_within_seconds(served, bundle, base) -> None:
    server, live, watch, path = served
    history = base.ids.item_ids[:3].tolist()
    with RecClient(server.address) as client:
        before = client.recommend("u", history=history, k=K, mode="plain")
        assert NEW not in items(before)
        with pytest.raises(grpc.RpcError) as err:  # not in the catalog yet
            client.record("u", [NEW])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the new item's text vector is the user's last item's: it is this user's best fresh match
        code = free_codes(base.ids, 1)[0]
        write(path, {"version": 1, "add": [add_entry(NEW, code, vector_of(bundle, history[-1]))], "retire": []})
        eventually(lambda: NEW in items(client.recommend("u", history=history, k=K, mode="plain")))
        for mode in ("plain", "strict"):
            out = client.recommend("u", history=history, k=K, mode=mode)
            assert items(out)[:-1] == items(before)[:-1] and items(out)[-1] == NEW
            assert out.items[-1].semantic_id == [f"<{lv}_{c}>" for lv, c in zip("abcd", code, strict=True)]
            assert out.items[-1].score == pytest.approx(1.0, abs=1e-4)  # its cosine similarity
        assert client.record("u", [NEW]) == 1  # a known item now: stored, and a valid history item
        assert len(client.recommend("u", k=K, mode="strict").items) == K
    assert watch.applied == 1 and live.state.catalog.version == 1
    registry = server.metrics.registry
    assert registry.get_sample_value("recsvc_catalog_version") == 1
    assert registry.get_sample_value("recsvc_catalog_items") == len(base.ids) + 1


def test_a_retired_item_never_appears_again(served, base) -> None:
    server, live, watch, path = served
    histories = [base.ids.item_ids[i : i + 3].tolist() for i in (0, 10, 20)]
    with RecClient(server.address) as client:
        first = client.recommend("u", history=histories[0], k=K, mode="plain")
        gone = items(first)[0]  # the model's first choice
        popular = client.recommend("nobody", k=K)  # no history: the popularity fallback
        write(path, {"version": 1, "add": [], "retire": [gone, items(popular)[0]]})
        eventually(lambda: watch.applied == 1)
        retired = {gone, items(popular)[0]}
        for history in histories:
            for mode in ("plain", "strict", "relaxed"):
                out = client.recommend("u", history=history, k=K, mode=mode, seed=3)
                assert len(out.items) == K and not retired & set(items(out)), (mode, history)
        cold = client.recommend("nobody", k=K)
        assert len(cold.items) == K and not retired & set(items(cold))
        # a retired item may still be in a history (it was bought): accepted, never recommended
        out = client.recommend("u", history=[gone], k=K, mode="plain")
        assert len(out.items) == K and gone not in items(out)
    assert server.metrics.registry.get_sample_value("recsvc_catalog_items") == len(base.ids) - 2


@pytest.mark.parametrize(("content", "reason"), [
    ('{"version": 2, "add": [', "not a readable JSON file"),
    ("COLLIDE", "is already item"),
    ({"version": 2, "add": [], "retire": [999999]}, "retire[0]: item 999999 is in neither"),
    ({"version": 2, "add": [add_entry(NEW + 5, [1, 2, 3, 4], [0.1] * (DIM + 1))], "retire": []},
     f"has {DIM + 1} dimensions, the served item embeddings have {DIM}"),
])
def test_a_malformed_update_is_rejected_and_the_old_catalog_keeps_serving(served, base, caplog, content,
                                                                           reason) -> None:
    server, live, watch, path = served
    caplog.set_level(logging.INFO, logger=WATCH_LOG)
    code = free_codes(base.ids, 1, seed=7)[0]
    write(path, {"version": 1, "add": [add_entry(NEW, code, [0.3] * DIM)], "retire": [int(base.ids.item_ids[0])]})
    eventually(lambda: watch.applied == 1)
    queries = [(base.ids.item_ids[i : i + 4].tolist(), mode) for i in (0, 7) for mode in ("plain", "strict")]
    with RecClient(server.address) as client:
        def answers() -> list[list[tuple[int, float]]]:
            return [[(i.item_id, i.score) for i in client.recommend("u", history=h, k=K, mode=m).items]
                    for h, m in queries]

        before = answers()
        if content == "COLLIDE":  # a second item on the first one's id
            content = {"version": 2, "add": [add_entry(NEW, code, [0.3] * DIM),
                                             add_entry(NEW + 1, code, [0.3] * DIM)], "retire": []}
        write(path, content)
        eventually(lambda: watch.rejected == 1)
        assert answers() == before
    rejected = [r for r in caplog.records if r.name == WATCH_LOG and r.getMessage() == "catalog_update_rejected"]
    assert len(rejected) == 1 and rejected[0].levelno == logging.WARNING
    assert reason in rejected[0].fields["reason"] and rejected[0].fields["serving_version"] == 1
    assert live.state.catalog.version == 1 and live.known_item(NEW)
    assert server.metrics.registry.get_sample_value("recsvc_catalog_updates_total", {"outcome": "rejected"}) == 1


def test_swaps_under_load_fail_no_request(served, base) -> None:
    server, live, watch, path = served
    errors: list[BaseException] = []
    answered = [0]
    stop = threading.Event()
    new_items = [NEW + i for i in range(4)]
    codes = free_codes(base.ids, len(new_items), seed=11)

    def load(user: str) -> None:
        with RecClient(server.address) as client:
            while not stop.is_set():
                try:
                    out = client.recommend(user, history=base.ids.item_ids[:4].tolist() + [NEW], k=K,
                                           mode="strict" if user == "a" else "plain") if live.known_item(NEW) else \
                        client.recommend(user, history=base.ids.item_ids[:4].tolist(), k=K, mode="plain")
                    assert len(out.items) == K and len(set(items(out))) == K
                    answered[0] += 1
                except BaseException as exc:  # noqa: BLE001 (reported below)
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=load, args=(u,)) for u in ("a", "b")]
    for t in threads:
        t.start()
    try:
        for version in range(1, len(new_items) + 1):  # grow the catalog one item per version
            adds = [add_entry(i, c, [0.2] * DIM) for i, c in zip(new_items[:version], codes, strict=False)]
            write(path, {"version": version, "add": adds, "retire": [int(base.ids.item_ids[version])]})
            eventually(lambda v=version: live.state.catalog.version == v)
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:1]
    assert answered[0] > 0 and watch.rejected == 0 and watch.applied == len(new_items)


def test_a_malformed_file_at_start_fails_before_serving(base, tmp_path) -> None:
    path = tmp_path / "catalog_live.json"
    path.write_text(json.dumps({"version": 1, "retire": [999999]}))
    with pytest.raises(UserError, match="catalog_live.json: retire"):
        watch_catalog(base, path)



def test_recsvc_serve_follows_the_catalog_commands(bundle, tmp_path, monkeypatch) -> None:
    """`recsvc serve --catalog FILE` as a process; `recsvc catalog retire` writes the file it watches."""
    only_commands(monkeypatch, "catalog")
    catalog = tmp_path / "live.json"
    cmd = [sys.executable, "-m", "recsvc.cli.main", "serve", "--bundle", str(bundle), "--dtype", "fp32", "--port",
           "0", "--spec", "off", "--catalog", str(catalog), "--threads", "1", "--grace-s", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def next_event(name: str, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if json_line(line).get("event") == name:
                return json_line(line)
        raise AssertionError(f"no {name} event:\n" + "".join(lines[-30:]))

    try:
        assert next_event("catalog_watching")["file"] == str(catalog)
        address = next_event("serving")["address"]
        with RecClient(address) as client:
            top = items(client.recommend("u", history=[1, 2, 3], k=K, mode="plain"))[0]
            assert cli.main(["catalog", "retire", "--bundle", str(bundle), "--catalog", str(catalog),
                             "--items", str(top)]) == 0
            updated = next_event("catalog_updated", timeout_s=10)
            assert updated["version"] == 1 and updated["retired"] == 1 and updated["added"] == 0
            assert top not in items(client.recommend("u", history=[1, 2, 3], k=K, mode="plain"))
            catalog.write_text("{")  # a hand edit gone wrong
            assert "not a readable JSON file" in next_event("catalog_update_rejected", timeout_s=10)["reason"]
            assert top not in items(client.recommend("u", history=[1, 2, 3], k=K, mode="plain"))
    finally:
        stop(proc)
