"""Rules through the engine facade, a real localhost gRPC server and the client CLI, on a tiny real bundle
(random tiny LLaMA target, a draft head, attributes from the synthetic items.json by `recsvc bundle attributes`)."""

from __future__ import annotations

import argparse
import json
import os
import time

import grpc
import pytest
import torch
from test_drafter_fixtures import tiny_bundle

from recsvc.bundle.directory import Bundle
from recsvc.cli.main import main
from recsvc.client import cli as client_cli
from recsvc.client.client import RecClient, rules_message
from recsvc.drafters.head_model import DraftHead, HeadConfig, save_head
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender
from recsvc.rule_decoding.decode import RuleSettings
from recsvc.rules.spec import STRATEGIES, Boost, Cap, Rules, ValueFilter

K = 5


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tiny_bundle(tmp_path_factory.mktemp("rules"), n_users=40)
    target = Bundle.open(root).load_target(dtype="fp32")
    cfg = target.config
    head = DraftHead(HeadConfig(hidden=cfg.hidden_size, levels=4, codebook=256))
    code_offset = Bundle.open(root).prompt_builder().code_offset
    head.init_from_lm_head(target.get_output_embeddings().weight, code_offset)
    save_head(head, Bundle.open(root).head_path())
    assert main(["bundle", "attributes", "--bundle", str(root), "--from-title"]) == 0
    return root


@pytest.fixture(scope="module")
def rec(bundle):
    torch.set_num_threads(1)
    return BundleRecommender.from_bundle(bundle, dtype="fp32")


def brands(rec: BundleRecommender, items: list[int]) -> list[str]:
    return [rec.rule_catalog.attrs.values["brand"][i][0] for i in items]


def test_attributes_file_holds_brand_categories_and_the_title_category(bundle) -> None:
    doc = json.loads((bundle / "attributes.json").read_text())
    first = doc["items"]["1"]
    assert first["brand"] == "acme" and "makeup" in first["categories"] and first["category"] == "makeup"
    assert set(doc["attributes"]) == {"brand", "categories", "category"}


@pytest.mark.parametrize("mode", ["plain", "strict"])
def test_rules_with_no_effect_give_exactly_todays_output(rec, mode) -> None:
    catalog = rec.rule_catalog
    every_category = frozenset(catalog.index["categories"].vocab)
    idle = Rules(caps=(Cap("brand", K),), allow=(ValueFilter("categories", every_category),),
                 deny=(ValueFilter("brand", frozenset({"no such brand"})),), boosts=(Boost("brand", "acme", 0.0),))
    histories = [[1, 2, 3], [7, 9], [30, 31, 32, 33, 2]]
    today = rec.recommend([RecQuery(history=h, k=K, mode=mode) for h in histories])
    for strategy in STRATEGIES:
        ruled = rec.variant(rules=RuleSettings(strategy=strategy))
        got = ruled.recommend([RecQuery(history=h, k=K, mode=mode, rules=idle) for h in histories])
        for a, b in zip(today, got, strict=True):
            assert a.item_ids == b.item_ids and a.scores == b.scores, strategy


def test_every_exact_strategy_returns_k_items_under_a_brand_cap(rec) -> None:
    rules = Rules(caps=(Cap("brand", 1),), boosts=(Boost("brand", "kirra", 0.5),))
    for strategy in ("beam", "cdsl", "cdlh"):
        ruled = rec.variant(rules=RuleSettings(strategy=strategy))
        (res,) = ruled.recommend([RecQuery(history=[1, 2, 3, 4], k=K, mode="plain", rules=rules)])
        assert len(res.item_ids) == K and len(set(brands(rec, res.item_ids))) == K, strategy
        assert res.scores == sorted(res.scores, reverse=True)


def test_attributes_are_reloaded_when_the_file_changes(bundle, tmp_path) -> None:
    path = tmp_path / "attributes.json"
    path.write_text((bundle / "attributes.json").read_text())
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", attributes=path)
    rec.attributes.check_every_s = 0.0
    query = RecQuery(history=[1, 2], k=K, mode="plain", rules=Rules(deny=(ValueFilter("stock", frozenset({"out"})),)))
    with pytest.raises(Exception):  # noqa: B017 (no "stock" attribute yet)
        rec.rule_catalog.index["stock"]
    (before,) = rec.recommend([RecQuery(history=[1, 2], k=K, mode="plain")])
    doc = json.loads(path.read_text())
    doc["items"][str(before.item_ids[0])]["stock"] = "out"  # the hourly stock export marks the top item
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on a coarse clock
    (after,) = rec.recommend([query])
    assert "stock" in rec.rule_catalog.names and rec.attributes.reloads == 1
    assert before.item_ids[0] not in after.item_ids and len(after.item_ids) == K


@pytest.mark.parametrize("rules, message", [
    (rules_message(max_per={"brnd": 2}), "rules.max_per[0].attribute: unknown attribute 'brnd' (known: brand"),
    (rules_message(max_per={"brand": 0}), "rules.max_per[0].m must be >= 1 (got 0)"),
    (rules_message(max_per=[("brand", 2), ("brand", 1)]), "rules.max_per[1]: a second cap on 'brand'"),
    (rules_message(allow={"category": []}), "rules.allow[0].values is empty"),
    (rules_message(allow={"category": ["skn"]}), "rules.allow[0].values: unknown value 'skn' of 'category'"),
    (rules_message(deny={"": ["x"]}), "rules.deny[0].attribute is empty"),
    (rules_message(boosts=[("brand", "acme", float("inf"))]), "rules.boosts[0].weight must be finite"),
    (rules_message(boosts=[("brand", "nope", 1.0)]), "rules.boosts[0].value: unknown value 'nope' of 'brand'"),
])
def test_bad_rules_are_invalid_argument_with_the_field_named(make_server, rec, rules, message) -> None:
    server = make_server(rec)
    with RecClient(f"127.0.0.1:{server.port}") as client, pytest.raises(grpc.RpcError) as err:
        client.recommend("u", history=[1, 2], k=K, mode="plain", rules=rules)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details(), err.value.details()


def test_caps_in_relaxed_mode_and_rules_without_attributes_are_invalid_argument(make_server, rec, catalog) -> None:
    server = make_server(rec)
    with RecClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(grpc.RpcError) as err:
            client.recommend("u", history=[1, 2], k=K, mode="relaxed", rules=rules_message(max_per={"brand": 1}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "RELAXED" in err.value.details()
        allowed = client.recommend("u", history=[1, 2], k=K, mode="relaxed", seed=1,
                                   rules=rules_message(allow={"category": ["makeup"]}))
    assert {rec.rule_catalog.attrs.values["category"][i.item_id][0] for i in allowed.items} == {"makeup"}
    bare = make_server(catalog)  # a popularity server: no item attributes
    with RecClient(f"127.0.0.1:{bare.port}") as client, pytest.raises(grpc.RpcError) as err:
        client.recommend("u", history=[1], rules=rules_message(max_per={"brand": 1}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no item attributes" in err.value.details()


def test_rules_over_grpc_and_the_popularity_fallback(make_server, rec) -> None:
    server = make_server(rec)
    rules = rules_message(max_per={"brand": 1}, allow={"category": ["makeup", "skin"]})
    with RecClient(f"127.0.0.1:{server.port}") as client:
        out = client.recommend("u", history=[1, 2, 3], k=K, mode="strict", rules=rules)
        cold = client.recommend("nobody", k=K, rules=rules)  # no history: popular items, same rules
        short = client.recommend("u", history=[1, 2], k=K, mode="plain",
                                 rules=rules_message(allow={"category": ["fragrance"]}, max_per={"brand": 1}))
    for response in (out, cold):
        items = [i.item_id for i in response.items]
        assert len(items) == K and len(set(brands(rec, items))) == K
        cats = rec.rule_catalog.attrs.values["category"]
        assert {cats[i][0] for i in items} <= {"makeup", "skin"}
    assert cold.fallback_reason.startswith("no_history")
    feasible = len(rec.popular_items(K, (), Rules(caps=(Cap("brand", 1),), allow=(
        ValueFilter("category", frozenset({"fragrance"})),))))
    assert len(short.items) == feasible
    if feasible < K:
        assert short.fallback_reason == f"only {feasible} items remain after exclusions and rules"


def _client(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="recsvc")
    client_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["client", *argv])
    return args.func(args)


def test_client_cli_rule_flags(make_server, rec, capsys) -> None:
    server = make_server(rec)
    target = f"127.0.0.1:{server.port}"
    argv = ["recommend", "--target", target, "--user", "u", "--history", "1,2,3", "--k", str(K), "--mode", "plain",
            "--max-per", "brand=1", "--allow", "category=makeup,skin", "--deny", "brand=acme",
            "--boost", "category=skin:0.5"]
    assert _client(argv) == 0
    items = [i["item_id"] for i in json.loads(capsys.readouterr().out)["items"]]
    assert len(items) == K and len(set(brands(rec, items))) == K and "acme" not in brands(rec, items)
    assert _client(argv[:-2] + ["--max-per", "brand=0"]) == 2  # INVALID_ARGUMENT from the server
    assert "rules.max_per[1].m must be >= 1" in capsys.readouterr().err
    for bad in (["--max-per", "brand"], ["--max-per", "brand=x"], ["--boost", "brand=acme"], ["--allow", "=a"]):
        with pytest.raises(SystemExit) as exit_:
            _client(["recommend", "--target", target, "--user", "u", *bad])
        assert exit_.value.code == 2


def test_bundle_attributes_command_bands_prices_and_keeps_extra_fields(bundle, tmp_path, capsys) -> None:
    items = {"1": {"asin": "A", "title": "Olay Night Cream", "price": "$19.99", "in_stock": True},
             "2": {"asin": "B", "title": "OPI Nail Lacquer", "brand": "O.P.I", "price": 120, "categories": ["Nail"]}}
    path = tmp_path / "items.json"
    path.write_text(json.dumps(items))
    out = tmp_path / "attrs.json"
    assert main(["bundle", "attributes", "--bundle", str(bundle), "--items", str(path), "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attributes"]["price_band"]["values"] == 2
    doc = json.loads(out.read_text())["items"]
    assert doc["1"] == {"in_stock": "yes", "price_band": "10-25"}
    assert doc["2"] == {"brand": "o.p.i", "categories": "nail", "price_band": "100+"}


def test_serve_refuses_attributes_without_a_model(tmp_path, capsys) -> None:
    pop = tmp_path / "pop.json"
    pop.write_text(json.dumps({"1": 3, "2": 1}))
    assert main(["serve", "--popularity", str(pop), "--attributes", str(pop), "--port", "0"]) == 2
    assert "--attributes needs --bundle" in capsys.readouterr().err


def test_bench_rules_command_on_a_tiny_bundle(bundle, tmp_path) -> None:
    out = tmp_path / "rules.json"
    assert main(["bench", "rules", "--bundle", str(bundle), "--users", "3", "--k", "3", "--caps", "1",
                 "--allow", "category=makeup,skin", "--beam-width", "0", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["scenario"], r["strategy"]) for r in rows} >= {("no rules", "plain"), ("brand m=1", "cdsl"),
                                                              ("allow category=makeup,skin", "postfilter")}
    exact = [r for r in rows if r["strategy"] in ("plain", "beam", "cdsl", "cdlh")]
    assert all(r["compliance"] == 100.0 and r["exact_k"] == 100.0 for r in exact)
    by = {(r["scenario"], r["strategy"]): r for r in rows}
    # the ledger splits each request's milliseconds: look-aheads only where a strategy has one, phases add up
    phases = {s: by[("brand m=1", s)]["phases_ms"] for s in ("beam", "cdsl", "cdlh")}
    assert phases["cdlh"]["lookahead"] > 0 and "lookahead" in phases["cdsl"]
    assert "lookahead" not in phases["beam"] and "compile" in phases["beam"]
    for r in rows:
        assert sum(r["phases_ms"].values()) == pytest.approx(r["ms"]) and r["phases_ms"]["forward"] > 0
