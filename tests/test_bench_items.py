"""`recsvc bench items` on tiny bundles: the item-level target's served paths beside a token target's, the
repeat identical to the new request, and the lists against exhaustive scoring (a width of the whole catalog:
identical)."""

from __future__ import annotations

import json

import pytest
from test_drafter_fixtures import tiny_bundle
from test_timeline_serving import make_items_bundle
from test_train_fixtures import one_thread  # noqa: F401

from recsvc.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_items_beside_a_token_target(tmp_path, capsys) -> None:
    items = make_items_bundle(tmp_path / "items")
    tokens = tiny_bundle(tmp_path / "tokens")
    out = tmp_path / "items.json"
    assert main(["bench", "items", "--bundle", str(items), "--against", str(tokens), "--users", "8", "--k", "5",
                 "--split", "valid", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    paths = {r["path"]: r for r in res["paths"]}
    assert set(paths) == {"items", "items-repeat", "tokens", "tokens-repeat"}
    assert paths["items"]["target_calls"] == 5  # the timeline and the decoder's 4 levels
    assert paths["items-repeat"]["target_calls"] == 0 and res["repeat_equals_new"]
    assert res["items_over_tokens_p50"] > 0
    assert res["exhaustive"]["users"] == 8 and 0 <= res["exhaustive"]["overlap"] <= 1
    capsys.readouterr()
    assert main(["bench", "items", "--bundle", str(tokens), "--users", "2"]) == 2
    assert "no item-level target" in capsys.readouterr().err
