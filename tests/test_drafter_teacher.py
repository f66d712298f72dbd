"""Teacher data: shapes, prefix mapping, agreement with the engine and teacher forcing, resume, staleness,
lambda-mixed sampling, and the drafter's tree batch (one forward == one forward per sequence)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_drafter_fixtures import forced_code_logprobs, tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.bundle.directory import Bundle
from recsvc.bundle.loading import save_causal_lm
from recsvc.bundle.presets import new_model
from recsvc.bundle.prompt import PromptBuilder
from recsvc.data.split import load_split_dir
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.errors import UserError
from tokenizer_rqvae.trie import CatalogTrie
from training.drafters.losses import code_logprobs_tree
from training.drafters.teacher import TeacherStore, build_teacher, collate_tree, shard_name, teacher_dir

pytestmark = pytest.mark.usefixtures("one_thread")
K, N_PREFIXES, SHARD = 4, 70, 32


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tiny_bundle(tmp_path_factory.mktemp("teacher"))
    meta = build_teacher(root, k=K, max_prefixes=N_PREFIXES, batch_size=8, shard_size=SHARD, dtype="fp32",
                         progress=False)
    bundle = Bundle.open(root)
    data = load_split_dir(bundle.data_dir())
    builder = PromptBuilder(bundle.load_tokenizer(), bundle.load_ids())
    return bundle, meta, data, builder


def test_shapes_and_prefix_mapping(built) -> None:
    bundle, meta, data, _ = built
    out = teacher_dir(bundle)
    assert meta["complete"] and meta["k"] == K and meta["num_prefixes"] == N_PREFIXES and meta["num_shards"] == 3
    assert bundle.is_done("teacher")
    sizes = []
    for s in range(3):
        t = load_file(str(out / shard_name(s)))
        n = len(t["index"])
        sizes.append(n)
        assert t["codes"].shape == (n, K, 4) and t["codes"].dtype == torch.int16
        assert t["logp"].shape == (n, K, 4, 256) and t["logp"].dtype == torch.float16
        assert t["gt_codes"].shape == (n, 4) and t["gt_logp"].shape == (n, 4, 256)
        assert t["index"].tolist() == list(range(s * SHARD, s * SHARD + n))
        assert torch.all(t["logp"] <= 0) and torch.all(t["logp"].float().exp().sum(-1) <= 1.001)  # not renormalised
    assert sizes == [32, 32, 6]
    store = TeacherStore(out)
    assert len(store) == N_PREFIXES and store.k == K
    for u, t, item in zip(store.user.tolist(), store.position.tolist(), store.item.tolist(), strict=True):
        assert 1 <= t < len(data.train[u]) and data.train[u][t] == item
    assert not list(out.glob("*.tmp"))


def test_beams_are_the_engine_top_k_and_logprobs_are_the_targets(built) -> None:
    bundle, _, data, builder = built
    store = TeacherStore(teacher_dir(bundle))
    trie = CatalogTrie(builder.ids)
    target = bundle.load_target(dtype="fp32")
    idx = [0, 5, 33, 69]
    rows = store.rows(idx)
    prompts = [builder.prompt_ids(data.train[int(store.user[i])][: int(store.position[i])]) for i in idx]
    engine = BeamSearch(EngineModel.build(target, "fp32"), trie, builder.code_offset)
    res = engine.search(PromptBatch.from_lists(prompts), K)
    assert torch.equal(rows["codes"].long(), trie.codes_of_nodes(res.leaves))
    for r, i in enumerate(idx):
        assert rows["gt_codes"][r].tolist() == builder.ids.codes[builder.ids.index_of(int(store.item[i]))].tolist()
        for kk in range(K):
            ref = forced_code_logprobs(target, prompts[r], rows["codes"][r, kk].tolist(), builder.code_offset)
            torch.testing.assert_close(rows["logp"][r, kk].float(), ref, atol=2e-2, rtol=1e-3)
        ref = forced_code_logprobs(target, prompts[r], rows["gt_codes"][r].tolist(), builder.code_offset)
        torch.testing.assert_close(rows["gt_logp"][r].float(), ref, atol=2e-2, rtol=1e-3)


def test_resume_rebuilds_only_missing_shards_and_config_changes_need_force(built) -> None:
    bundle, _, _, _ = built
    out = teacher_dir(bundle)
    kept = {s: os.stat(out / shard_name(s)).st_mtime_ns for s in (0, 2)}
    before = load_file(str(out / shard_name(1)))
    (out / shard_name(1)).unlink()  # an interrupted build
    meta = build_teacher(bundle.root, k=K, max_prefixes=N_PREFIXES, batch_size=8, shard_size=SHARD, dtype="fp32",
                         progress=False)
    assert meta["complete"]
    assert {s: os.stat(out / shard_name(s)).st_mtime_ns for s in (0, 2)} == kept  # skipped
    after = load_file(str(out / shard_name(1)))
    for name in before:
        assert torch.equal(before[name], after[name])
    with pytest.raises(UserError, match="another configuration"):
        build_teacher(bundle.root, k=K + 1, max_prefixes=N_PREFIXES, shard_size=SHARD, dtype="fp32", progress=False)


def test_tree_batch_forward_equals_one_forward_per_sequence(built) -> None:
    bundle, _, data, builder = built
    store = TeacherStore(teacher_dir(bundle))
    trie = CatalogTrie(builder.ids)
    drafter = bundle.load_drafter(dtype="fp32")
    idx = [3, 40, 68]
    rows = store.rows(idx)
    prompts = [builder.prompt_ids(data.train[int(store.user[i])][: int(store.position[i])]) for i in idx]
    batch = collate_tree(rows, prompts, trie, builder.code_offset, builder.tokenizer.pad_token_id, K)
    assert batch["slot_level"].shape[1] - 1 <= (K + 1) * 3
    assert batch["allowed"].shape == (3, K, 4, 256) and batch["allowed"][..., 0, :].sum() > 0
    with torch.no_grad():
        lq, lq_gt = code_logprobs_tree(drafter, batch, builder.code_offset)
    assert lq.shape == (3, K, 4, 256) and lq_gt.shape == (3, 4, 256)
    for r in range(3):
        for kk in range(K):
            ref = forced_code_logprobs(drafter, prompts[r], rows["codes"][r, kk].tolist(), builder.code_offset)
            torch.testing.assert_close(lq[r, kk], ref, atol=1e-5, rtol=1e-5)
        ref = forced_code_logprobs(drafter, prompts[r], rows["gt_codes"][r].tolist(), builder.code_offset)
        torch.testing.assert_close(lq_gt[r], ref, atol=1e-5, rtol=1e-5)
        # allowed = the trie's children of each prefix
        codes = rows["codes"][r, 1].tolist()
        for t in range(4):
            assert torch.nonzero(batch["allowed"][r, 1, t]).reshape(-1).tolist() == trie.allowed_codes(codes[:t])


def test_lambda_mix_takes_the_drafters_beams_and_a_new_target_makes_it_stale(tmp_path) -> None:
    root = tiny_bundle(tmp_path, n_users=20)
    meta = build_teacher(root, k=3, max_prefixes=12, batch_size=5, shard_size=8, lambda_mix=1.0, dtype="fp32",
                         progress=False)
    assert meta["drafter"] is not None
    bundle = Bundle.open(root)
    store = TeacherStore(teacher_dir(bundle))
    assert store.source.tolist() == [1] * 12
    data = load_split_dir(bundle.data_dir())
    builder = PromptBuilder(bundle.load_tokenizer(), bundle.load_ids())
    trie = CatalogTrie(builder.ids)
    prompts = [builder.prompt_ids(data.train[int(store.user[i])][: int(store.position[i])]) for i in range(12)]
    drafter = bundle.load_drafter(dtype="fp32")
    engine = BeamSearch(EngineModel.build(drafter, "fp32"), trie, builder.code_offset, tie_break="index")  # as built
    own = engine.search(PromptBatch.from_lists(prompts), 3)
    rows = store.rows(range(12))
    assert torch.equal(rows["codes"].long(), trie.codes_of_nodes(own.leaves))
    target = bundle.load_target(dtype="fp32")  # the log-probs stay the target's
    ref = forced_code_logprobs(target, prompts[0], rows["codes"][0, 0].tolist(), builder.code_offset)
    torch.testing.assert_close(rows["logp"][0, 0].float(), ref, atol=2e-2, rtol=1e-3)

    store.check_target(bundle)
    save_causal_lm(new_model("tiny", bundle.load_tokenizer(), seed=7), bundle.target_dir)  # the target changed
    with pytest.raises(UserError, match="another target"):
        store.check_target(bundle)
    with pytest.raises(UserError, match="another configuration or target"):
        build_teacher(root, k=3, max_prefixes=12, batch_size=5, shard_size=8, lambda_mix=1.0, dtype="fp32",
                      progress=False)
    meta = build_teacher(root, k=3, max_prefixes=12, batch_size=5, shard_size=8, dtype="fp32", force=True,
                         progress=False)
    assert json.loads((teacher_dir(bundle) / "meta.json").read_text())["lambda_mix"] == 0.0
    TeacherStore(teacher_dir(bundle)).check_target(bundle)


def test_shared_prefixes_are_one_tree_node(built) -> None:
    """Two beams with the same first code and the truth equal to the first beam: 5 nodes, not 9."""
    bundle, _, _, builder = built
    trie = CatalogTrie(builder.ids)
    codes = builder.ids.codes.tolist()
    a, b = next((x, y) for x in codes for y in codes if x != y and x[0] == y[0])
    rows = {"codes": torch.tensor([[a, b]], dtype=torch.int16), "logp": torch.zeros(1, 2, 4, 256),
            "gt_codes": torch.tensor([a], dtype=torch.int16), "gt_logp": torch.zeros(1, 4, 256)}
    batch = collate_tree(rows, [[1, 5, 6]], trie, builder.code_offset, 0, 2)
    assert batch["slot_level"][0].tolist() == [0, 1, 2, 2, 3, 3]  # root output, then nodes parents first
    assert batch["slot"][0, 0, 0] == batch["slot"][0, 1, 0] == 0  # position 0: the prompt's last token
    assert batch["slot"][0, 0, 1] == batch["slot"][0, 1, 1]  # the shared first code: one node
    assert torch.equal(batch["slot"][0, 0], batch["slot"][0, 2])  # the truth reuses beam 0's nodes
    assert int(batch["num_tokens"]) == 3 + 5
