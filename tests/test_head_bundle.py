"""The recurrent draft head end to end on a real tiny bundle: `recsvc train head` writes BUNDLE/head (resumable
checkpoints, bad input exits 2), the served recommender picks it by default and strict speculation with it equals
plain beam search, and `recsvc bench speculative --drafter head` reports it with the transition opener."""

from __future__ import annotations

import json

import pytest
import torch
from cli_commands import only_commands
from test_drafter_fixtures import tiny_bundle as make_tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.data.split import load_split_dir
from recsvc.drafters.head import HeadDrafter
from recsvc.recommender.api import RecQuery
from recsvc.recommender.bundle_recommender import BundleRecommender

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    only_commands(monkeypatch, "prior", "bench", "train")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = make_tiny_bundle(tmp_path_factory.mktemp("head"), n_users=60)
    with pytest.MonkeyPatch.context() as mp:
        only_commands(mp, "prior", "train")
        assert cli.main(["prior", "fit", "--bundle", str(root), "--weight", "1.0"]) == 0
        assert cli.main(["train", "head", "--bundle", str(root), "--prefixes", "200", "--epochs", "2", "--k", "4",
                         "--dtype", "fp32", "--method", "wordkd", "--alpha", "1.0"]) == 0
    return root


def test_train_head_writes_the_head_and_refuses_bad_input(bundle, capsys) -> None:
    b = Bundle.open(bundle)
    info = json.loads((b.head_path() / "config.json").read_text())
    assert info["method"] == "wordkd" and info["k"] == 4 and len(info["history"]) == 2
    assert 0.0 <= info["best"]["val_topk_containment"] <= 1.0
    assert b.is_done("head")
    # a finished run leaves a checkpoint: rerunning needs --resume or --force
    assert cli.main(["train", "head", "--bundle", str(bundle), "--prefixes", "200", "--epochs", "2", "--k", "4",
                     "--dtype", "fp32", "--method", "wordkd"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli.main(["train", "head", "--bundle", str(bundle), "--alpha", "2"]) == 2
    assert "--alpha" in capsys.readouterr().err


def test_served_head_is_the_default_drafter_and_strict_equals_plain(bundle) -> None:
    rec = BundleRecommender.from_bundle(bundle, dtype="fp32")
    assert isinstance(rec.drafter, HeadDrafter) and rec.drafter.opener is not None  # the prior opens
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    hist = [u.history[-8:] for u in data.eval_users("valid")[:5]]
    plain = rec.recommend([RecQuery(history=h, k=4, mode="plain") for h in hist])
    strict = rec.recommend([RecQuery(history=h, k=4, mode="strict") for h in hist])
    assert [r.item_ids for r in strict] == [r.item_ids for r in plain]
    assert all(r.stats.draft_calls == 0 for r in strict)
    relaxed = rec.recommend([RecQuery(history=h, k=4, mode="relaxed", seed=3) for h in hist])
    assert all(len(set(r.item_ids)) == 4 for r in relaxed)


def test_bench_speculative_with_the_head(bundle, tmp_path) -> None:
    out = tmp_path / "spec.json"
    assert cli.main(["bench", "speculative", "--bundle", str(bundle), "--users", "4", "--k", "3", "--drafter",
                     "head", "--grid", "K:3", "--dtype", "fp32", "--split", "valid", "--calibration-users", "2",
                     "--head-opener", "none", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["identical"] == 1.0 and r["draft_calls"] == 0 for r in rows)
    spec = [r for r in rows if r["N"] > 0]
    assert spec and all(r["target_calls_spec"] >= 2 for r in spec)  # no opener: the prefill is a call of its own


@pytest.mark.parametrize("exclude_history", [False, True])
def test_served_head_strict_over_the_bucketed_forward_is_a_handful_of_replays(bundle, exclude_history) -> None:
    """The served recommender (draft head, the prior's transition opener, fused prior, the history excluded or
    not) over the bucketed forward (CUDA graphs' stand-in): a strict request gives plain's lists, with at most
    twice plain's eager device ops, at most 4 graph replays more, and a whole request (prior, exclusions, lists
    read out) reads the device at most twice: plain once (its lists), strict twice (its counters, its lists)."""
    from recsvc.engine.meters.host_reads import HostReads
    from recsvc.engine.meters.launches import Launches

    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", forward="bucketed", exclude_history=exclude_history)
    assert isinstance(rec.drafter, HeadDrafter) and rec.drafter.opener is not None
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    for u in data.eval_users("valid")[:3]:
        counts = {}
        for mode in ("plain", "strict"):
            query = [RecQuery(history=u.history[-8:], k=10, mode=mode)]
            rec.recommend(query)  # first use: buckets, caches
            with Launches() as ops:
                (out,) = rec.recommend(query)
            with HostReads(rec.target.device) as reads:
                rec.recommend(query)
            assert out.decoding is not None and out.decoding.mode == mode
            counts[mode] = (out.item_ids, ops.total, ops.replays, reads.total)
        (items, ops, replays, reads), (plain_items, plain_ops, plain_replays, plain_reads) = (counts["strict"],
                                                                                              counts["plain"])
        assert items == plain_items
        if exclude_history:
            assert not set(items) & set(u.history[-8:])
        assert ops <= 2 * plain_ops and replays <= plain_replays + 4 and reads <= 2, counts
        assert plain_reads == 1 and reads == 2, counts


def test_served_head_relaxed_is_unrolled_with_the_eager_loops_lists(bundle) -> None:
    """Relaxed on the served recommender over the bucketed forward: a whole request within strict's bounds (at
    most twice plain's eager ops, 4 replays more, 2 device reads: its counters and its lists), and the head's
    unrolled sampling gives the eager loop's lists for the same seeds (each request's noise drawn ahead)."""
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.meters.host_reads import HostReads
    from recsvc.engine.meters.launches import Launches
    from recsvc.engine.search.sampling import make_generators
    from recsvc.engine.speculation.relaxed.relaxed import relaxed_speculative_search

    rec = BundleRecommender.from_bundle(bundle, dtype="fp32", forward="bucketed")
    data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
    users = data.eval_users("valid")[:4]
    for u in users[:2]:
        counts = {}
        for mode in ("plain", "relaxed"):
            query = [RecQuery(history=u.history[-8:], k=10, mode=mode, seed=3)]
            rec.recommend(query)
            with Launches() as ops:
                (out,) = rec.recommend(query)
            with HostReads(rec.target.device) as reads:
                rec.recommend(query)
            assert out.decoding is not None and out.decoding.mode == mode
            counts[mode] = (ops.total, ops.replays, reads.total)
        (ops, replays, reads), (plain_ops, plain_replays, _) = counts["relaxed"], counts["plain"]
        assert ops <= 2 * plain_ops and replays <= plain_replays + 4 and reads == 2, counts
    hist = [u.history[-8:] for u in users]
    prompts = PromptBatch.from_lists([rec.prompts.prompt_ids(h) for h in hist], rec.target.device)
    prior = rec.prior_for(hist)
    temps = torch.ones(len(hist))
    runs = {}
    for unrolled in (False, True):
        runs[unrolled] = [relaxed_speculative_search(
            rec.target, rec.trie, rec.prompts.code_offset, prompts, 10,
            rec.drafter.sampling_session(prompts, hist, None, prior), 10, 3, temps,
            make_generators([seed + i for i in range(len(hist))]), None, prior, unrolled=unrolled)
            for seed in (0, 10, 20)]
    for eager, out in zip(runs[False], runs[True], strict=True):
        assert torch.equal(out.leaves, eager.leaves) and torch.equal(out.accepted, eager.accepted)


def test_the_head_alone_runs_one_target_forward_and_bench_reports_its_quality(bundle, tmp_path, capsys) -> None:
    """NEZHA-style decoding: the target's prompt prefill ranks the first code exactly, the head the others; one
    target forward, the catalog's items only, the history excluded when asked; `recsvc bench speculative --mode
    head` reports Recall@K / NDCG@K of both and the share of identical lists (and refuses another drafter)."""
    from recsvc.drafters.head_alone import head_alone_search
    from recsvc.engine.caches.prompts import PromptBatch

    for forward in ("fast", "bucketed"):
        rec = BundleRecommender.from_bundle(bundle, dtype="fp32", forward=forward)
        data = load_split_dir(Bundle.open(bundle).resolve_data_dir())
        hist = [u.history[-8:] for u in data.eval_users("valid")[:3]]
        prompts = PromptBatch.from_lists([rec.prompts.prompt_ids(h) for h in hist], rec.target.device)
        dead = rec.trie.dead_nodes(hist)
        out = head_alone_search(rec.target, rec.trie, rec.prompts.code_offset, prompts, 6, rec.drafter, dead,
                                rec.prior_for(hist))
        assert out.target_calls == 1 and out.head_steps == rec.trie.levels - 1
        assert out.leaves.shape == (3, 6) and bool((out.leaves >= rec.trie.num_internal).all())
        assert bool((out.scores[:, :-1] >= out.scores[:, 1:]).all())  # best first
        for r, h in enumerate(hist):
            items = rec.trie.leaf_items(out.leaves[r])
            assert len(set(items)) == 6 and not set(items) & set(h)
        if forward == "fast":
            first = out.leaves
        else:  # the bucketed forward: the same beams
            assert torch.equal(out.leaves, first)
    path = tmp_path / "head.json"
    assert cli.main(["bench", "speculative", "--bundle", str(bundle), "--users", "6", "--k", "4", "--drafter",
                     "head", "--mode", "head", "--dtype", "fp32", "--split", "valid", "--count-users", "1",
                     "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["setting"] == "head" and row["target_calls_spec"] == 1 and 0.0 <= row["identical"] <= 1.0
    assert {"recall_plain", "recall_spec", "ndcg_plain", "ndcg_spec"} <= set(row)
    assert cli.main(["bench", "speculative", "--bundle", str(bundle), "--users", "2", "--k", "4", "--drafter",
                     "llama", "--mode", "head", "--dtype", "fp32", "--json", str(path)]) == 2
    assert "--drafter head" in capsys.readouterr().err
