"""The dense head (LIGER-style): its targets and loss, `recsvc build --dense-head` end to end, the served merge."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_commands import only_commands
from test_train_fixtures import make_data, one_thread, small_tokenizer, write_ids  # noqa: F401

import recsvc.cli.main as cli
from recsvc.bundle.directory import Bundle
from recsvc.bundle.prompt import PromptBuilder
from recsvc.content.dense_head import (
    DenseHead,
    DenseRetriever,
    DenseSettings,
    has_dense_head,
    pool_matched,
    read_settings,
)
from recsvc.data.split import load_split_dir
from recsvc.errors import UserError
from tokenizer_rqvae.ids import SemanticIds
from training.target_lm.dense_loss import DenseLoss
from training.target_lm.sequences import collate, train_examples


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch, tmp_path_factory):
    only_commands(monkeypatch, "train", "build", "tune", "eval")
    monkeypatch.setenv("RECSVC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "emb-cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    d = make_data(root, n_users=40)
    return d, write_ids(d, root / "ids.json")


def test_targets_name_the_item_each_first_code_starts(data) -> None:
    d, ids_path = data
    ids = SemanticIds.load(ids_path)
    builder = PromptBuilder(small_tokenizer(), ids, max_history=5, header="compact")
    split = load_split_dir(d)
    examples = train_examples(builder, split.train, stride=2)[:6]
    batch = collate(examples, 0)
    known = list(range(len(ids)))
    loss = DenseLoss(builder, torch.randn(len(ids), 8), known, DenseSettings())
    b, p, tgt = loss.targets(batch["input_ids"], batch["labels"])
    labelled_items = sum(sum(1 for t in e.labels if t != -100) // 4 for e in examples)
    assert len(b) == labelled_items > 0  # one per labelled item
    for r, pos, t in zip(b.tolist(), p.tolist(), tgt.tolist(), strict=True):
        item = int(ids.item_ids[t])
        assert batch["input_ids"][r, pos + 1 : pos + 5].tolist() == builder.item_token_ids(item)
    # items outside the known set are no target
    half = DenseLoss(builder, torch.randn(len(ids), 8), known[: len(ids) // 2], DenseSettings())
    b2, _, tgt2 = half.targets(batch["input_ids"], batch["labels"])
    assert len(b2) < len(b) and int(tgt2.max()) < len(ids) // 2


def test_merge_ranks_beams_and_nearest_items_by_one_score() -> None:
    ids = SemanticIds.from_mapping({10: (0, 0, 0, 0), 20: (0, 0, 0, 1), 30: (0, 0, 1, 0), 40: (1, 0, 0, 0)})
    items = torch.eye(4)
    head = DenseHead(4, 4)
    ret = DenseRetriever(head, items, DenseSettings(blend=0.0, candidates=2))
    sims = torch.tensor([0.1, 0.2, 0.9, 0.8])
    assert not ret.active
    assert ret.merge([10, 20], [-1.0, -2.0], sims, ids, 2)[0] == [10, 20]  # blend 0: the beams' order
    ret = ret.with_settings(blend=2.0, floor=0.5)
    # 10: -1 + 0.2 = -0.8; 20: -2 + 0.4 = -1.6; 30: -2.5 + 1.8 = -0.7; 40: -2.5 + 1.6 = -0.9
    got, scores = ret.merge([10, 20], [-1.0, -2.0], sims, ids, 4)
    assert got == [30, 10, 40, 20]
    assert scores == pytest.approx([-0.7, -0.8, -0.9, -1.6])
    assert ret.merge([10, 20], [-1.0, -2.0], sims, ids, 4, excluded=[30])[0] == [10, 40, 20]  # excluded stays out
    assert ret.merge([10, 20], [-1.0, -2.0], sims, ids, 2)[0] == [30, 10]
    # pool "fresh": only the items the target was not trained on (here 40)
    known = torch.tensor([True, True, True, False])
    fresh = DenseRetriever(head, items, DenseSettings(blend=2.0, floor=0.5, candidates=2, pool="fresh"), known=known)
    assert fresh.merge([10, 20], [-1.0, -2.0], sims, ids, 4)[0] == [10, 40, 20]
    # a past period's catalog without item 30: the head adds 40 only; a beam item outside it stays
    assert ret.within([0, 3]).merge([10, 20], [-1.0, -2.0], sims, ids, 4)[0] == [10, 40, 20]


def test_pool_calibration_ranks_a_fresh_item_among_the_fresh_ones() -> None:
    """The head's cosines to fresh items sit low (its softmax never pulled a query towards them): ``calibrate
    pool`` puts them on the known items' mean and spread, per query, so the nearest fresh item can enter."""
    ids = SemanticIds.from_mapping({10: (0, 0, 0, 0), 20: (0, 0, 0, 1), 30: (0, 0, 1, 0), 40: (1, 0, 0, 0),
                                    50: (1, 1, 0, 0)})
    items, head = torch.eye(5), DenseHead(5, 5)
    known = torch.tensor([True, True, True, False, False])
    sims = torch.tensor([0.6, 0.5, 0.4, 0.1, 0.0])  # the fresh items 40, 50 far below every known one
    settings = DenseSettings(blend=4.0, floor=0.0, candidates=1, pool="fresh")
    plain = DenseRetriever(head, items, settings, known=known)
    # 10: -1 + 2.4 = 1.4; 20: -1.2 + 2.0 = 0.8; 40: -1.2 + 0.4 = -0.8: below both beams
    assert plain.merge([10, 20], [-1.0, -1.2], sims, ids, 3)[0] == [10, 20, 40]
    matched = pool_matched(sims, known)
    assert matched[:3].tolist() == sims[:3].tolist()  # the known rows are kept
    # the fresh rows (mean 0.05, sd 0.0707) put on the known rows' (mean 0.5, sd 0.1): 0.5 +- 0.1 / sqrt(2)
    assert matched[3].item() == pytest.approx(0.5 + 0.1 / 2**0.5) and matched[3:].mean().item() == pytest.approx(0.5)
    calibrated = plain.with_settings(calibrate="pool")  # 40: -1.2 + 4 * 0.571 = 1.08: between the two beams
    assert calibrated.merge([10, 20], [-1.0, -1.2], sims, ids, 3)[0] == [10, 40, 20]
    # an absent row counts in neither pool; without two fresh rows nothing changes
    assert torch.equal(pool_matched(sims, known, torch.tensor([False, False, False, False, True])), sims)
    with pytest.raises(UserError):
        DenseSettings(calibrate="zscore")



def _build(data_dir, ids_path, out, *extra: str) -> None:
    """A tiny deploy-protocol bundle (a 1-epoch scratch refit), with ``extra`` build flags."""
    argv = ["build", "--data", str(data_dir), "--out", str(out), "--ids", str(ids_path), "--preset", "tiny",
            "--batch-size", "8", "--eval-users", "10", "--bf16", "off", "--protocol", "deploy", "--refit", "scratch",
            "--refit-epochs", "1", "--patience", "0", *extra]
    assert cli.main(argv) == 0


@pytest.mark.usefixtures("one_thread")
def test_build_with_dense_head_saves_and_serves_it(data, tmp_path) -> None:
    d, ids_path = data
    out = tmp_path / "bundle"
    _build(d, ids_path, out, "--epochs", "2", "--recall-users", "10", "--dense-head", "1.0")
    b = Bundle.open(out)
    info = json.loads((b.target_dir / "training.json").read_text())
    assert info["dense_head"]["weight"] == 1.0 and info["dense_head"]["temperature"] == 0.07
    for directory in (b.target_dir, b.train_only_target_dir):
        assert has_dense_head(directory)
        keys = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"] if (
            directory / "model.safetensors.index.json").is_file() else None
        assert keys is None  # one file
        from safetensors import safe_open

        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            assert not any(k.startswith("dense_head") for k in f.keys())  # the LM file holds the LM only
    ret = DenseRetriever.load(b.target_dir, b.load_ids())
    assert ret.items.shape[0] == len(b.load_ids())
    assert np.allclose(ret.items.norm(dim=1).numpy(), 1.0, atol=1e-5)
    assert read_settings(b.target_dir).blend == 0.0  # not merged until tuned

    # the dense loss trained: the head's query ranks a valid target above a random item more often than not
    from recsvc.bundle.loading import load_causal_lm
    from recsvc.content.dense_head import last_hidden

    model = load_causal_lm(b.train_only_target_dir, dtype="fp32")
    split = load_split_dir(d)
    builder = b.prompt_builder(ids=b.load_ids())
    users = split.eval_users("valid")
    hidden = last_hidden(model, [builder.prompt_ids(u.history) for u in users])
    ret_train = DenseRetriever.load(b.train_only_target_dir)
    sims = ret_train.similarities(hidden)
    assert sims.shape == (len(users), len(b.load_ids()))


@pytest.fixture(scope="module")
def dense_bundle(data, tmp_path_factory):
    """A deploy bundle whose targets carry a dense head (tiny preset, one epoch each phase)."""
    d, ids_path = data
    out = tmp_path_factory.mktemp("dense-bundle") / "bundle"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    argv = ["build", "--data", str(d), "--out", str(out), "--ids", str(ids_path), "--preset", "tiny", "--epochs", "1",
            "--batch-size", "8", "--eval-users", "10", "--select-by", "loss", "--bf16", "off", "--protocol",
            "deploy", "--refit", "scratch", "--refit-epochs", "1", "--patience", "0", "--dense-head", "0.5"]
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.usefixtures("one_thread")
def test_tune_dense_chooses_on_validation_and_records_it(dense_bundle, tmp_path) -> None:
    b = Bundle.open(dense_bundle)
    report_file = tmp_path / "dense.json"
    argv = ["tune", "dense", "--bundle", str(dense_bundle), "--users", "8", "--blends", "0,4,64", "--floors", "0,1",
            "--threads", "1", "--json", str(report_file)]
    assert cli.main(argv) == 0
    report = json.loads(report_file.read_text())
    trials = [(4.0, 0.0), (4.0, 1.0), (64.0, 0.0), (64.0, 1.0)]
    assert [(g["pool"], g["calibrate"], g["blend"], g["floor"]) for g in report["grid"]] == (
        [("all", "none", 0.0, 0.0)] + [(p, c, *t) for p in ("all", "fresh") for c in ("none", "pool")
                                       for t in trials])
    best = max(report["grid"], key=lambda g: (g["ndcg@10"], -g["blend"]))
    assert report["chosen"]["blend"] == best["blend"] and report["chosen"]["floor"] == best["floor"]
    assert (report["chosen"]["pool"], report["chosen"]["calibrate"]) == (best["pool"], best["calibrate"])
    assert report["tuning_users"] == 8
    assert report["all"]["users"] == report["tuning_users"] + report["held_out"]["users"]
    for directory in (b.target_dir, b.train_only_target_dir):  # both targets serve the choice
        s = read_settings(directory)
        assert (s.blend, s.floor) == (best["blend"], best["floor"]) and s.tuned["chosen"] == report["chosen"]
    # the cold guard: the most cold recall within one paired SE of the best NDCG@10; --no-write keeps the choice
    guard_file = tmp_path / "guard.json"
    assert cli.main(argv[:-2] + ["--rule", "cold-guard", "--no-write", "--json", str(guard_file)]) == 0
    guard = json.loads(guard_file.read_text())
    assert guard["rule"] == "cold-guard"
    allowed = [g for g in guard["grid"] if g["ndcg_gap_se"] >= -1.0]
    assert best["ndcg@10"] == max(g["ndcg@10"] for g in guard["grid"]) and allowed
    most = max(g["cold"].get("recall@10", 0.0) for g in allowed)
    picked = next(g for g in guard["grid"] if (g["pool"], g["calibrate"], g["blend"], g["floor"]) == (
        guard["chosen"]["pool"], guard["chosen"]["calibrate"], guard["chosen"]["blend"], guard["chosen"]["floor"]))
    assert picked in allowed and picked["cold"].get("recall@10", 0.0) == most
    assert read_settings(b.target_dir).tuned["rule"] == "ndcg"  # not written


@pytest.mark.usefixtures("one_thread")
def test_served_and_evaluated_lists_merge_the_head_items(dense_bundle, tmp_path) -> None:
    """With a large blend the head's nearest items lead the list: the recommender and `recsvc eval` both merge."""
    from dataclasses import replace

    from recsvc.bundle.loading import load_causal_lm
    from recsvc.content.dense_head import write_settings
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender

    b = Bundle.open(dense_bundle)
    for directory in (b.target_dir, b.train_only_target_dir):
        write_settings(directory, replace(read_settings(directory), blend=1000.0, floor=0.0, candidates=5))
    split = load_split_dir(b.data_dir())
    history = next(iter(split.train.values()))
    rec = BundleRecommender.from_bundle(dense_bundle, dtype="fp32", use_drafter=False, beam_width=10)
    plain = BundleRecommender.from_bundle(dense_bundle, dtype="fp32", use_drafter=False, beam_width=10,
                                          use_dense=False)
    assert rec.dense is not None and plain.dense is None
    (res,) = rec.recommend([RecQuery(history=history, k=5, mode="plain")])
    (base,) = plain.recommend([RecQuery(history=history, k=5, mode="plain")])
    ret = DenseRetriever.load(b.target_dir)
    from recsvc.content.dense_head import last_hidden

    sims = ret.similarities(last_hidden(rec.target.model, [rec.prompts.prompt_ids(history)]))[0]
    ids = b.load_ids()
    by_sim = sorted(res.item_ids, key=lambda i: -float(sims[ids.index_of(i)]))
    assert res.item_ids == by_sim  # a blend this large orders the list by the head's cosine
    assert len(res.item_ids) == 5 and res.item_ids != base.item_ids

    # the validation searches (tune history / fresh) rank the lists the bundle serves: merged too
    from training.tuning.validation_lists import ValidationLists

    user = split.eval_users("valid")[0]
    listed = ValidationLists(b, split, ids, "fp32").rank([user], exclude_history=False, k=5)[user.user_id]
    model = load_causal_lm(b.train_only_target_dir, dtype="fp32")
    train_sims = DenseRetriever.load(b.train_only_target_dir).similarities(
        last_hidden(model, [rec.prompts.prompt_ids(user.history)]))[0]
    assert listed == sorted(listed, key=lambda i: -float(train_sims[ids.index_of(i)]))

    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--bundle", str(dense_bundle), "--split", "test", "--k", "5", "--baselines", "none",
                     "--against-variant", "no-dense", "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["dense"]["active"] and merged["dense"]["blend"] == 1000.0
    assert merged["against"]["dense"] is None and merged["against"]["parts"]["dense"] is False
    assert cli.main(["eval", "--bundle", str(dense_bundle), "--split", "test", "--k", "5", "--baselines", "none",
                     "--no-dense", "--json", str(out)]) == 0
    beams = json.loads(out.read_text())
    assert beams["dense"] is None
    # the same bundle without its head, ranked beside it by --against-variant: the --no-dense run's lists
    assert merged["against"]["metrics"] == beams["model"]
    assert merged["against"]["lead"]["all"]["recall@5"]["baseline"] == pytest.approx(beams["model"]["recall@5"])


@pytest.mark.usefixtures("one_thread")
def test_train_dense_head_on_a_frozen_target(data, tmp_path) -> None:
    """`recsvc train dense-head`: a head per target, fitted on its own period; the target's weights unchanged."""
    from safetensors.torch import load_file

    d, ids_path = data
    out = tmp_path / "bundle"
    _build(d, ids_path, out, "--epochs", "1", "--select-by", "loss")
    b = Bundle.open(out)
    assert not has_dense_head(b.target_dir)
    before = {n: t.clone() for n, t in load_file(str(b.target_dir / "model.safetensors")).items()}
    assert cli.main(["train", "dense-head", "--bundle", str(out), "--epochs", "2", "--threads", "1",
                     "--dtype", "fp32"]) == 0
    after = load_file(str(b.target_dir / "model.safetensors"))
    assert all(torch.equal(before[n], after[n]) for n in before)
    meta = b.read()["dense_head"]
    assert set(meta["targets"]) == {b.target_dir.name, b.train_only_target_dir.name}
    split = load_split_dir(d)
    n_train = len({i for s in split.sequences("train").values() for i in s})
    n_both = len({i for s in split.sequences("train+valid").values() for i in s})
    assert meta["targets"][b.train_only_target_dir.name]["items"] == n_train
    assert meta["targets"][b.target_dir.name]["items"] == n_both
    losses = [h["loss"] for h in meta["targets"][b.target_dir.name]["history"]]
    assert losses[1] < losses[0]  # the head learns
    for directory in (b.target_dir, b.train_only_target_dir):
        assert has_dense_head(directory) and read_settings(directory).backbone == "frozen"


def test_a_growing_catalog_keeps_each_items_embedding_and_joins_new_ones() -> None:
    """``over``: the rows follow the new catalog by item id; new items are fresh to the target and the head can add
    them; without text vectors it never does."""
    ids = SemanticIds.from_mapping({10: (0, 0, 0, 0), 20: (0, 0, 0, 1), 30: (0, 0, 1, 0)})
    grown = SemanticIds.from_mapping({10: (0, 0, 0, 0), 15: (2, 0, 0, 0), 20: (0, 0, 0, 1), 30: (0, 0, 1, 0)})
    items = torch.eye(4)[:3]
    ret = DenseRetriever(DenseHead(4, 4), items, DenseSettings(blend=2.0, candidates=2, pool="fresh"),
                         known=torch.tensor([True, True, False]))
    ret.item_ids = ids.item_ids.astype(np.int64)
    over = ret.over(grown, np.array([15]), np.array([[0.0, 0.0, 0.0, 3.0]]))
    assert over.item_ids.tolist() == [10, 15, 20, 30]
    assert torch.equal(over.items[[0, 2, 3]], items) and torch.allclose(over.items[1], torch.tensor([0., 0, 0, 1]))
    assert over.known.tolist() == [True, False, True, False]
    sims = torch.tensor([0.1, 0.9, 0.2, 0.3])  # rows of the grown catalog
    # 10: -1 + 0.2; 15: -1 + 1.8; 30: -1 + 0.6 (floor 0)
    assert over.merge([10], [-1.0], sims, grown, 3)[0] == [15, 30, 10]  # the new item 15 leads
    blind = ret.over(grown, np.array([15]), np.zeros((1, 0)))  # no vectors: 15 is never added
    assert blind.merge([10], [-1.0], sims, grown, 3)[0] == [30, 10]


@pytest.mark.usefixtures("one_thread")
def test_the_heads_query_is_the_decodings_prefill_not_another_forward(dense_bundle) -> None:
    """Plain and strict decoding return each prompt's final hidden state [B, H] from their own prefill: the dense
    head's query, which transformers computes the same, so serving a merged list runs the prompt once."""
    from dataclasses import replace

    from recsvc.content.dense_head import last_hidden, write_settings
    from recsvc.drafters.oracle import OracleDrafter
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.entry.dispatch import decode
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender

    b = Bundle.open(dense_bundle)
    write_settings(b.target_dir, replace(read_settings(b.target_dir), blend=8.0, floor=0.0, candidates=5))
    split = load_split_dir(b.data_dir())
    histories = [h for h in split.train.values() if h][:3]
    rec = BundleRecommender.from_bundle(dense_bundle, dtype="fp32", use_drafter=False, beam_width=10)
    prompts = [rec.prompts.prompt_ids(h) for h in histories]
    batch = PromptBatch.from_lists(prompts, rec.target.device)
    expected = last_hidden(rec.target.model, prompts)  # [B, H]
    plain = decode(rec.engine, None, batch, histories, "plain", 10, (0, 0))
    strict = decode(rec.engine, OracleDrafter(rec.engine, 10), batch, histories, "strict", 10, (10, 2))
    assert strict.decoding.mode == "strict"
    for out in (plain, strict):
        assert out.prompt_hidden is not None and out.prompt_hidden.shape == expected.shape
        torch.testing.assert_close(out.prompt_hidden.float(), expected, atol=1e-4, rtol=1e-4)

    calls = []  # forwards of the transformers backbone, the engine's own included
    hook = rec.target.model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        merged = rec.recommend([RecQuery(history=histories[0], k=5, mode="plain")])[0]
        with_head = len(calls)
        calls.clear()
        beams = BundleRecommender.from_bundle(dense_bundle, dtype="fp32", use_drafter=False, beam_width=10,
                                              use_dense=False)
        beams.target.model.model.register_forward_hook(lambda *_: calls.append(1))
        beams.recommend([RecQuery(history=histories[0], k=5, mode="plain")])
    finally:
        hook.remove()
    assert rec.dense is not None and rec.dense.active and len(merged.item_ids) == 5
    assert with_head == len(calls)  # the merge ran no forward of its own
