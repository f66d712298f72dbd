"""Drafter training per method on a tiny bundle: each method runs, saves under BUNDLE/drafters/<method>, and
lowers its own loss on a fixed teacher batch; AS-based selection; exact resume of an alignment run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_drafter_fixtures import tiny_bundle
from test_train_fixtures import one_thread  # noqa: F401 (a fixture)

from recsvc.bundle.directory import Bundle
from recsvc.bundle.loading import load_causal_lm
from recsvc.bundle.presets import new_model
from recsvc.bundle.prompt import PromptBuilder
from recsvc.data.split import load_split_dir
from recsvc.errors import UserError
from tokenizer_rqvae.trie import CatalogTrie
from training.drafters.losses import METHODS, code_logprobs_tree, method_loss
from training.drafters.teacher import TeacherStore, build_teacher, collate_tree, teacher_dir
from training.drafters.train import acceptance_evaluator, train_drafter, validation_metric
from training.target_lm.train import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")
K, ALPHA = 4, 0.5


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tiny_bundle(tmp_path_factory.mktemp("train"))
    build_teacher(root, k=K, max_prefixes=160, batch_size=16, shard_size=64, progress=False)
    return Bundle.open(root)


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"epochs": 3, "batch_size": 16, "lr": 5e-3, "seed": 0, "patience": 0, "bf16": "off", **kw})


def fixed_batch(bundle: Bundle):
    store = TeacherStore(teacher_dir(bundle))
    data = load_split_dir(bundle.data_dir())
    builder = PromptBuilder(bundle.load_tokenizer(), bundle.load_ids())
    idx = list(range(0, len(store), 4))
    prompts = [builder.prompt_ids(data.train[int(store.user[i])][: int(store.position[i])]) for i in idx]
    batch = collate_tree(store.rows(idx), prompts, CatalogTrie(builder.ids), builder.code_offset,
                         builder.tokenizer.pad_token_id, K)
    return batch, builder


def loss_of(model, method: str, batch, builder) -> float:
    with torch.no_grad():
        lq, lq_gt = code_logprobs_tree(model.eval(), batch, builder.code_offset)
        return float(method_loss(method, ALPHA, lq, lq_gt, batch, K)[0])


@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_and_lowers_its_loss(bundle, method: str) -> None:
    info = train_drafter(bundle.root, preset="drafter-tiny", method=method, cfg=cfg(), eval_max_users=20,
                         alpha=ALPHA, out_name=method)
    out = bundle.root / "drafters" / method
    assert info["out"] == str(out) and (out / "config.json").is_file()
    assert info["epochs"] == 3 and info["best"]["metric"] == "valid_loss"
    assert bundle.is_done(f"drafter:{method}") and bundle.read()["drafter"] is None  # the served one untouched
    history = json.loads((out / "training.json").read_text())["history"]
    assert len(history) == 3 and history[-1]["valid_loss"] < history[0]["valid_loss"] + 0.5
    batch, builder = fixed_batch(bundle)
    before = loss_of(new_model("drafter-tiny", builder.tokenizer, seed=0), method, batch, builder)
    after = loss_of(load_causal_lm(out, dtype="fp32"), method, batch, builder)
    assert after < before - 0.05, (method, before, after)
    if method != "sft":
        assert info["k"] == (None if method in ("wordkd", "tvdkd") else K) and info["alpha"] == ALPHA


def test_selection_by_acceptance(bundle) -> None:
    info = train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-s", cfg=cfg(epochs=2),
                         eval_max_users=10, out_name="as", select_by="as", as_users=6, as_k=3, k=2)
    assert info["best"]["metric"] == "as@3" and 0.0 <= info["best"]["value"] <= 3.0 and info["k"] == 2
    history = json.loads((bundle.root / "drafters" / "as" / "training.json").read_text())["history"]
    assert all("as@3" in row and "calls@3" in row for row in history)
    assert all(1.0 <= row["calls@3"] <= 4.0 for row in history)
    assert all(0.0 <= row["as_relaxed@3"] <= 4.0 and 1.0 <= row["calls_relaxed@3"] <= 4.0 for row in history)


def test_atspeed_r_selects_by_relaxed_acceptance(bundle) -> None:
    info = train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-r", cfg=cfg(epochs=2),
                         eval_max_users=10, out_name="as-r", select_by="as", as_users=6, as_k=3, k=2)
    history = json.loads((bundle.root / "drafters" / "as-r" / "training.json").read_text())["history"]
    assert info["best"]["metric"] == "as_relaxed@3"
    assert info["best"]["value"] == max(row["as_relaxed@3"] for row in history)
    assert validation_metric("atspeed-r", "strict", 10) == "as@10"
    assert validation_metric("seqkd", "auto", 5) == "as@5" and validation_metric("sft", "relaxed", 5) == "as_relaxed@5"
    with pytest.raises(UserError, match="--verify"):
        validation_metric("seqkd", "lenient", 5)


def test_relaxed_validation_is_seeded(bundle) -> None:
    """Two evaluations of the same drafter see the same draws (epochs compare like for like)."""
    b = Bundle.open(bundle.root)
    builder = PromptBuilder(b.load_tokenizer(), b.load_ids())
    data = load_split_dir(b.resolve_data_dir(None))
    evaluate = acceptance_evaluator(b, builder, CatalogTrie(builder.ids), data, k=3, max_users=6, batch_size=4)
    model = new_model("drafter-tiny", builder.tokenizer, seed=0)
    first, second = evaluate(model), evaluate(model)
    assert first == second and set(first) == {"as@3", "calls@3", "as_relaxed@3", "calls_relaxed@3"}


def test_interrupted_alignment_run_resumes_exactly(bundle) -> None:
    straight = train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-r", cfg=cfg(epochs=2),
                             eval_max_users=10, out_name="r-straight")
    cut = train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-r", cfg=cfg(epochs=2, max_minutes=0.0),
                        eval_max_users=10, out_name="r-cut")
    assert cut["stopped"] == "max_minutes" and cut["steps"] == 1
    with pytest.raises(UserError, match="--resume"):
        train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-r", cfg=cfg(epochs=2), out_name="r-cut")
    resumed = train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-r", cfg=cfg(epochs=2, resume=True),
                            eval_max_users=10, out_name="r-cut")
    assert resumed["steps"] == straight["steps"]
    ckpt = bundle.root / "checkpoints"
    wa = load_file(str(ckpt / "drafter-r-straight" / "last" / "model.safetensors"))
    wb = load_file(str(ckpt / "drafter-r-cut" / "last" / "model.safetensors"))
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=1e-6)


def test_errors(bundle, tmp_path) -> None:
    with pytest.raises(UserError, match="unknown drafter method"):
        train_drafter(bundle.root, method="distill")
    with pytest.raises(UserError, match="--k 9"):
        train_drafter(bundle.root, preset="drafter-tiny", method="seqkd", cfg=cfg(), k=9, out_name="x", force=True)
    bare = tiny_bundle(tmp_path, n_users=12)
    with pytest.raises(UserError, match="recsvc train teacher"):
        train_drafter(bare, preset="drafter-tiny", method="atspeed-s", cfg=cfg())


def test_fit_budget_plans_an_alignment_run(bundle) -> None:
    """--fit-budget times the method's own batches and loss (a BatchSource); an ample budget keeps --epochs."""
    plain = train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-s", cfg=cfg(epochs=2),
                          eval_max_users=10, out_name="s-plain")
    fitted = train_drafter(bundle.root, preset="drafter-tiny", method="atspeed-s",
                           cfg=cfg(epochs=2, fit_budget=True, max_minutes=30.0), eval_max_users=10, out_name="s-fit")
    assert fitted["epochs"] == plain["epochs"] == 2 and fitted["steps"] == plain["steps"]
    state = json.loads((bundle.root / "checkpoints" / "drafter-s-fit" / "last" / "state.json").read_text())["state"]
    plan = state["budget_plan"]
    assert plan["epochs"] == 2 and plan["train_tokens_per_s"] > 0 and plan["epochs_fit"] > 2


def test_init_from_takes_a_trained_drafters_name(bundle) -> None:
    """``--init-from sft`` starts from BUNDLE/drafters/sft (its --out-name), as the help says; an unknown name is
    a UserError naming where it looked."""
    train_drafter(bundle.root, preset="drafter-tiny", method="sft", cfg=cfg(epochs=1), eval_max_users=10,
                  out_name="init-src")
    source = load_causal_lm(bundle.root / "drafters" / "init-src", dtype="fp32")
    info = train_drafter(bundle.root, preset="drafter-tiny", method="sft", cfg=cfg(epochs=1, lr=0.0),
                         eval_max_users=10, out_name="init-dst", init_from="init-src")
    started = load_causal_lm(info["out"], dtype="fp32")
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), started.parameters(), strict=True))
    with pytest.raises(UserError, match="no drafter 'nowhere'"):
        train_drafter(bundle.root, preset="drafter-tiny", method="sft", cfg=cfg(epochs=1), out_name="x",
                      init_from="nowhere")
