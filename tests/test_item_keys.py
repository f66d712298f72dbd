"""Item keys on the wire (the team's own item ids beside the split's numbers): the bundle's key table
(BUNDLE/item_keys.json from the split's ``asin``), every RPC with keys, numbers and both, the errors (unknown keys
named, one list sent both ways, a bundle without keys), the old generated stubs against the new server, keys of
live-catalog additions served within a second, and ``recsvc client`` with keys. A real gRPC server on 127.0.0.1
over a tiny real bundle; stored histories in a real redis-server."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from catalog_fixtures import NEW, add_entry, free_codes, live_bundle, vector_of
from service_helpers import status_of
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.bundle.keys import KEYS_FILE, ItemKeys, read_item_keys
from recsvc.catalog.file import parse_catalog
from recsvc.catalog.reader import read_catalog_isolated
from recsvc.client import cli as client_cli
from recsvc.client.client import RecClient
from recsvc.data.split import load_split_dir
from recsvc.errors import UserError
from recsvc.recommender.bundle_recommender import BundleRecommender
from recsvc.recommender.live_catalog import LiveRecommender
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.stores import open_store
from recsvc.service.swap.catalog_watch import watch_catalog

TESTS = Path(__file__).resolve().parent
K = 5
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return live_bundle(tmp_path_factory.mktemp("item-keys"))


@pytest.fixture(scope="module")
def base(bundle, one_thread) -> BundleRecommender:  # noqa: F811
    return BundleRecommender.from_bundle(bundle, dtype="fp32")


@pytest.fixture
def store(redis_server):
    store = open_store(redis_server.url, max_len=200)
    yield store
    store.close()


def key(rec: BundleRecommender, item: int) -> str:
    found = rec.key_of(item)
    assert found is not None
    return found


def items(response) -> list[int]:
    return [i.item_id for i in response.items]


def test_the_wire_adds_key_fields_and_keeps_the_old_ones() -> None:
    def numbers(message) -> dict[str, tuple[int, int]]:
        return {f.name: (f.number, f.type) for f in message.DESCRIPTOR.fields}

    string, int64 = 9, 3  # FieldDescriptor.TYPE_STRING, TYPE_INT64
    assert numbers(pb.RecommendRequest)["history"] == (2, int64)
    assert numbers(pb.RecommendRequest)["exclude_items"] == (5, int64)
    assert numbers(pb.RecommendRequest)["history_keys"] == (10, string)
    assert numbers(pb.RecommendRequest)["exclude_keys"] == (11, string)
    assert numbers(pb.RecommendedItem) == {"item_id": (1, int64), "score": (2, 2), "semantic_id": (3, string),
                                           "key": (4, string)}
    assert numbers(pb.RecordInteractionsRequest) == {"user_id": (1, string), "item_ids": (2, int64),
                                                     "item_keys": (3, string)}
    assert numbers(pb.GetHistoryResponse) == {"item_ids": (1, int64), "item_keys": (2, string)}


def test_the_bundle_holds_its_split_s_asins_as_keys(bundle, base) -> None:
    data = load_split_dir(base.parts.bundle.resolve_data_dir())
    doc = json.loads((bundle / KEYS_FILE).read_text())
    assert doc == {str(i): meta.asin for i, meta in data.items.items()}  # the synthetic split: SYN0000001, ...
    keys = read_item_keys(bundle)
    assert keys is not None and len(keys) == len(base.ids)
    for item in base.ids.item_ids.tolist():
        assert base.item_of_key(key(base, item)) == item
    assert base.item_of_key("NO-SUCH-KEY") is None and base.key_of(10**6) is None
    assert read_item_keys(bundle / "ids") is None  # a directory without the file: no keys
    with pytest.raises(UserError, match="'A' is both item 1's and item 2's"):
        ItemKeys.from_pairs([(1, "A"), (2, "A")])
    with pytest.raises(UserError, match="'X' is both item 1's and item 9's"):
        ItemKeys.from_pairs([(1, "X")]).with_items([(9, "X")])


def test_recommend_by_keys_numbers_and_both(base, make_server, store) -> None:
    server = make_server(base, store)
    history = base.ids.item_ids[:3].tolist()
    history_keys = [key(base, i) for i in history]
    with RecClient(server.address) as client:
        by_number = client.recommend("u", history=history, k=K, mode="plain")
        by_key = client.recommend("u", history_keys=history_keys, k=K, mode="plain")
        assert items(by_key) == items(by_number) and len(by_key.items) == K
        for out in (by_number, by_key):  # every returned item carries its key
            assert [i.key for i in out.items] == [key(base, i) for i in items(out)]
        first = items(by_number)[0]
        # exclusions by key; numbers in one list and keys in another are fine
        out = client.recommend("u", history=history, exclude_keys=[key(base, first)], k=K, mode="plain")
        assert first not in items(out) and len(out.items) == K
        out2 = client.recommend("u", history_keys=history_keys, exclude_items=[first], k=K, mode="plain")
        assert items(out2) == items(out)
        # the stored history (numbers in Redis) recorded by key
        assert client.record("s", item_keys=history_keys) == 3
        stored = client.recommend("s", k=K, mode="plain")
        assert items(stored) == items(by_number)
        cold = client.recommend("nobody", k=K)  # popular items carry keys too
        assert [i.key for i in cold.items] == [key(base, i) for i in items(cold)]


def test_record_and_history_with_keys_numbers_and_both(base, make_server, store) -> None:
    server = make_server(base, store)
    a, b, c = base.ids.item_ids[:3].tolist()
    with RecClient(server.address) as client:
        assert client.record("u", [a]) == 1
        assert client.record("u", item_keys=[key(base, b), key(base, c)]) == 3
        reply = client.get_history("u")
        assert list(reply.item_ids) == [a, b, c]  # stored as numbers
        assert list(reply.item_keys) == [key(base, a), key(base, b), key(base, c)]
        assert client.history("u") == [a, b, c]
    assert store.get("u") == [a, b, c]


def test_bad_keys_and_one_list_sent_both_ways_are_invalid_argument(base, make_server, store) -> None:
    server = make_server(base, store)
    a, b = base.ids.item_ids[:2].tolist()
    ka = key(base, a)
    many = [f"NOPE-{n}" for n in range(8)]
    with RecClient(server.address) as client:
        for field, call in [
            ("history_keys", lambda: client.recommend("u", history_keys=[ka, "NOPE-1", "NOPE-2"], k=K)),
            ("exclude_keys", lambda: client.recommend("u", history=[a], exclude_keys=["NOPE-1", "NOPE-2"], k=K)),
            ("item_keys", lambda: client.record("u", item_keys=["NOPE-1", ka, "NOPE-2"])),
        ]:
            code, details = status_of(call)
            assert code == INVALID and details == f"unknown item keys in {field}: 'NOPE-1', 'NOPE-2'", field
        code, details = status_of(lambda: client.recommend("u", history_keys=many, k=K))
        assert code == INVALID and details.endswith("'NOPE-4' and 3 more")  # the first few named
        for call, message in [
            (lambda: client.recommend("u", history=[a], history_keys=[ka], k=K), "history and history_keys"),
            (lambda: client.recommend("u", history=[a], exclude_items=[b], exclude_keys=[ka], k=K),
             "exclude_items and exclude_keys"),
            (lambda: client.record("u", [a], item_keys=[ka]), "item_ids and item_keys"),
        ]:
            code, details = status_of(call)
            assert code == INVALID and details.startswith(message) and "both set" in details, details
        assert client.history("u") == []  # nothing was stored by the rejected calls


def test_a_bundle_without_keys_refuses_them_and_serves_numbers(base, make_server, store) -> None:
    keyless = BundleRecommender(replace(base.parts, keys=None), base.settings)
    server = make_server(keyless, store)
    a = int(base.ids.item_ids[0])
    with RecClient(server.address) as client:
        for call in (lambda: client.recommend("u", history_keys=[key(base, a)], k=K),
                     lambda: client.recommend("u", history=[a], exclude_keys=[key(base, a)], k=K),
                     lambda: client.record("u", item_keys=[key(base, a)])):
            code, details = status_of(call)
            assert code == INVALID and details.startswith("this bundle has no item keys"), details
        out = client.recommend("u", history=[a], k=K, mode="plain")
        assert len(out.items) == K and all(i.key == "" for i in out.items)
        assert client.record("u", [a]) == 1
        reply = client.get_history("u")
        assert list(reply.item_ids) == [a] and list(reply.item_keys) == []


# The old client: the generated code from before the keys (tests/data/old_stubs), in a process of its own
# (it registers the same proto file as the new code in protobuf's default pool).
OLD_CLIENT = """
import json, sys
import grpc
sys.path.insert(0, sys.argv[1])
from old_stubs import recommender_pb2 as pb, recommender_pb2_grpc as pb_grpc
assert "key" not in pb.RecommendedItem.DESCRIPTOR.fields_by_name  # really the old stubs
target, history = sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
with grpc.insecure_channel(target) as channel:
    stub = pb_grpc.RecommenderStub(channel)
    rec = stub.Recommend(pb.RecommendRequest(user_id="old", history=history, k=5, mode=pb.PLAIN), timeout=30)
    length = stub.RecordInteractions(pb.RecordInteractionsRequest(user_id="old", item_ids=history), timeout=30)
    stored = stub.GetHistory(pb.GetHistoryRequest(user_id="old"), timeout=30)
    again = stub.Recommend(pb.RecommendRequest(user_id="old", k=5, mode=pb.PLAIN), timeout=30)
    try:
        stub.Recommend(pb.RecommendRequest(user_id="old", history=[10**9], k=5), timeout=30)
        bad = "OK"
    except grpc.RpcError as exc:
        bad = exc.code().name + ": " + exc.details()
print(json.dumps({"items": [i.item_id for i in rec.items], "semantic_ids": [list(i.semantic_id) for i in rec.items],
                  "mode": pb.DecodingMode.Name(rec.stats.mode), "length": length.history_length,
                  "stored": list(stored.item_ids), "again": [i.item_id for i in again.items], "bad": bad}))
"""


def test_old_stubs_work_against_the_new_server(base, make_server, store) -> None:
    server = make_server(base, store)
    history = base.ids.item_ids[:3].tolist()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", OLD_CLIENT, str(TESTS / "data"), server.address,
                          ",".join(map(str, history))], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    old = json.loads(run.stdout)
    with RecClient(server.address) as client:
        new = client.recommend("new", history=history, k=K, mode="plain")
    assert old["items"] == items(new) and old["mode"] == "PLAIN"
    assert old["semantic_ids"] == [list(i.semantic_id) for i in new.items]
    assert old["length"] == 3 and old["stored"] == history and old["again"] == items(new)
    assert old["bad"] == "INVALID_ARGUMENT: unknown item ids in history: 1000000000"


def test_a_live_addition_s_key_is_served_within_a_second(base, bundle, make_server, store, tmp_path) -> None:
    path = tmp_path / "catalog_live.json"
    live, watch = watch_catalog(base, path, check_every_s=0.05)
    try:
        server = make_server(live, store)
        history = base.ids.item_ids[:3].tolist()
        new_key = "TEAM-NEW-0001"
        # the new item's text vector is the user's last item's: it takes this user's fresh slot
        entry = {**add_entry(NEW, free_codes(base.ids, 1)[0], vector_of(bundle, history[-1])), "key": new_key}
        with RecClient(server.address) as client:
            code, details = status_of(lambda: client.record("u", item_keys=[new_key]))
            assert code == INVALID and new_key in details  # not in the catalog yet
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"version": 1, "add": [entry], "retire": []}))
            os.replace(tmp, path)
            written = time.monotonic()
            while status_of(lambda: client.recommend("u", history_keys=[new_key], k=K, mode="plain"))[0] != \
                    grpc.StatusCode.OK:
                assert time.monotonic() - written < 1.0, "the added key was not served within a second"
                time.sleep(0.01)
            assert live.key_of(NEW) == new_key and live.item_of_key(new_key) == NEW
            assert client.record("u", item_keys=[new_key]) == 1
            assert list(client.get_history("u").item_keys) == [new_key]
            out = client.recommend("v", history=history, k=K, mode="plain")
            assert items(out)[-1] == NEW and out.items[-1].key == new_key  # the fresh slot, with its key
            out = client.recommend("v", history=history, exclude_keys=[new_key], k=K, mode="plain")
            assert NEW not in items(out)
            # a key a bundle item has is refused: the file is rejected, the previous catalog keeps serving
            taken = key(base, history[0])
            second = {**add_entry(NEW + 1, free_codes(base.ids, 2)[1], vector_of(bundle, history[0])), "key": taken}
            tmp.write_text(json.dumps({"version": 2, "add": [entry, second], "retire": []}))
            os.replace(tmp, path)
            deadline = time.monotonic() + 10
            while watch.rejected == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert repr(taken) in (watch.last_reason or "") and live.state.catalog.version == 1
            assert client.recommend("u", history_keys=[new_key, taken], k=K).items
    finally:
        watch.close()


def test_live_catalog_keys_are_validated_and_read_back(base, tmp_path) -> None:
    codes = free_codes(base.ids, 3)
    doc = {"version": 1, "retire": [], "add": [
        {**add_entry(NEW + 2, codes[0], [0.1] * 8), "key": "B"},
        add_entry(NEW + 1, codes[1], [0.2] * 8),
        {**add_entry(NEW, codes[2], [0.3] * 8), "key": "A"}]}
    catalog = parse_catalog(doc, base.ids)
    assert catalog.item_ids.tolist() == [NEW, NEW + 1, NEW + 2] and catalog.keys == ("A", "", "B")
    assert catalog.key_pairs() == [(NEW, "A"), (NEW + 2, "B")]
    path = tmp_path / "catalog_live.json"
    catalog.save(path)
    assert read_catalog_isolated(path, base.ids).keys == ("A", "", "B")  # through the reader process
    assert parse_catalog({**doc, "add": doc["add"][1:2]}, base.ids).keys == ()
    first, rest = doc["add"][0], doc["add"][1:]
    for adds, message in [([{**first, "key": ""}, *rest], "add[0].key must be a non-empty string"),
                          ([{**first, "key": 7}, *rest], "add[0].key must be a non-empty string"),
                          ([{**first, "key": "A"}, *rest], "add[2].key: 'A' is already item 1003's key")]:
        with pytest.raises(UserError) as err:
            parse_catalog({**doc, "add": adds}, base.ids)
        assert str(err.value).startswith(message)
    live = LiveRecommender(base)
    live.apply(catalog)
    assert live.item_of_key("A") == NEW and live.key_of(NEW + 1) is None and live.has_item_keys
    assert live.item_of_key(key(base, 1)) == 1  # the bundle's keys stay


def _client(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="recsvc")
    client_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["client", *argv])
    return args.func(args)


def test_client_cli_takes_and_prints_keys(base, make_server, store, capsys) -> None:
    target = make_server(base, store).address
    a, b = base.ids.item_ids[:2].tolist()
    ka, kb = key(base, a), key(base, b)
    assert _client(["record", "--target", target, "--user", "u", "--item-keys", f"{ka},{kb}"]) == 0
    assert json.loads(capsys.readouterr().out) == {"user_id": "u", "history_length": 2}
    assert _client(["history", "--target", target, "--user", "u"]) == 0
    assert json.loads(capsys.readouterr().out) == {"user_id": "u", "item_ids": [a, b], "item_keys": [ka, kb]}
    assert _client(["recommend", "--target", target, "--user", "v", "--history-keys", f"{ka}, {kb}",
                    "--exclude-keys", ka, "--k", "3", "--mode", "plain"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["items"]) == 3 and all(i["key"] == key(base, i["item_id"]) for i in out["items"])
    assert _client(["recommend", "--target", target, "--user", "v", "--history-keys", "NOPE-9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: unknown item keys in history_keys: 'NOPE-9'")
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:  # one of --items / --item-keys
        _client(["record", "--target", target, "--user", "u", "--items", "1", "--item-keys", ka])
    assert exit_.value.code == 2
