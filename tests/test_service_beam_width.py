"""Beam width B decoupled from k: the top-k of a request is the head of its top-k' (k <= k' <= B), strict ==
plain under it, B = 0 keeps today's num_beams = k, and the serve flag is validated."""

from __future__ import annotations

import pytest
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.data.split import load_split_dir
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender

pytestmark = pytest.mark.usefixtures("one_thread")
WIDTH = 8


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("width"), n_users=50)


def histories(bundle, n: int = 6) -> list[list[int]]:
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    return [u.history[-10:] for u in data.eval_users("valid")[:n]]


def test_top_k_is_a_prefix_of_every_wider_top_k(bundle) -> None:
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", beam_width=WIDTH)
    for h in histories(bundle):
        widest = rec.recommend([RecQuery(history=h, k=WIDTH, mode="plain")])[0].item_ids
        for k in range(1, WIDTH + 1):
            plain, strict = rec.recommend([RecQuery(history=h, k=k, mode="plain"),
                                           RecQuery(history=h, k=k, mode="strict")])
            assert plain.item_ids == widest[:k] and strict.item_ids == plain.item_ids


def test_width_zero_is_num_beams_k(bundle) -> None:
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", beam_width=0)
    h = histories(bundle, 1)[0]
    got = rec.recommend([RecQuery(history=h, k=3, mode="plain")])[0]
    direct = rec.engine.search(PromptBatch.from_lists([rec.prompts.prompt_ids(h)]), 3)
    assert got.item_ids == rec.trie.leaf_items(direct.leaves[0][direct.leaves[0] >= 0])


def test_serve_rejects_a_bad_beam_width(bundle, capsys) -> None:
    assert cli.main(["serve", "--bundle", str(bundle), "--beam-width", "-1", "--port", "0"]) == 2
    assert "--beam-width" in capsys.readouterr().err


def test_bench_prefix_counts_every_user(bundle, tmp_path, monkeypatch) -> None:
    import json

    only_commands(monkeypatch, "bench")
    out = tmp_path / "prefix.json"
    assert cli.main(["bench", "prefix", "--bundle", str(bundle), "--users", "4", "--k", "1,3", "--beam-width", "6",
                     "--dtype", "fp32", "--split", "valid", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["passed"] == res["users"] == 4 and res["modes"] == ["plain", "strict"]
    assert cli.main(["bench", "prefix", "--bundle", str(bundle), "--k", "10", "--beam-width", "6"]) == 2
