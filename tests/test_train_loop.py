"""The training loop: loss, checkpoints (safetensors, no pickles), exact resume, early stopping, budget."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_fixtures import one_thread, random_ids, small_tokenizer  # noqa: F401 (one_thread: a fixture)

from recsvc.bundle.presets import new_model
from recsvc.bundle.prompt import PromptBuilder
from recsvc.data.split import EvalUser
from recsvc.hardware import native_bf16
from training.target_lm.sequences import collate, eval_examples, train_examples
from training.target_lm.train import (
    TrainConfig,
    fit_causal_lm,
    flatten_optimizer_state,
    lm_loss,
    resolve_bf16,
    unflatten_optimizer_state,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = small_tokenizer()
ITEMS = list(range(1, 31))
BUILDER = PromptBuilder(TOK, random_ids(ITEMS, seed=3), max_history=5)
# users walk the catalog in steps of 1 or 2: a learnable pattern
SEQS = {u: [ITEMS[(u + j * (1 + u % 2)) % 30] for j in range(3 + u % 7)] for u in range(1, 41)}
TRAIN = train_examples(BUILDER, SEQS)
VALID = eval_examples(BUILDER, [EvalUser(u, s[:-1], [s[-1]]) for u, s in list(SEQS.items())[:10]])


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"epochs": 2, "batch_size": 8, "lr": 3e-3, "seed": 0, "patience": 0, "bf16": "off",
                          **kw})


def test_resolve_bf16() -> None:
    cpu = torch.device("cpu")
    assert resolve_bf16("on", cpu) and not resolve_bf16("off", cpu)
    assert resolve_bf16("auto", cpu) == native_bf16("cpu")  # the hardware's own answer (recsvc.hardware)
    with pytest.raises(Exception, match="auto, on or off"):
        resolve_bf16("maybe", cpu)


@pytest.mark.parametrize("avx512_bf16, amx, expected", [
    (True, False, True),  # AVX512-BF16 (this project's dev CPU): bf16 autocast
    (False, True, True),  # AMX tiles
    (False, False, False),  # neither: fp32
])
def test_auto_bf16_follows_the_cpu_flags(monkeypatch, avx512_bf16, amx, expected) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert resolve_bf16("auto", torch.device("cpu")) is expected


def test_bf16_autocast_loop_runs(tmp_path) -> None:
    _, res = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN[:16], VALID, cfg(epochs=1, bf16="on"),
                           tmp_path, TOK.pad_token_id)
    assert res.steps == 2 and res.history[0]["valid_loss"] < 8


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lm_loss_matches_transformers_loss() -> None:
    model = new_model("tiny", TOK, seed=0)
    batch = collate(TRAIN[:6], TOK.pad_token_id)
    loss, n = lm_loss(model, batch)
    ref = model(**batch).loss  # transformers' own shifted, masked cross-entropy
    torch.testing.assert_close(loss, ref)
    assert n == int((batch["labels"] != -100).sum())


def test_optimizer_state_flatten_roundtrip() -> None:
    model = new_model("tiny", TOK, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        lm_loss(model, collate(TRAIN[:4], TOK.pad_token_id))[0].backward()
        opt.step()
    tensors, meta = flatten_optimizer_state(opt.state_dict())
    json.dumps(meta)  # the non-tensor part is plain JSON
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(unflatten_optimizer_state(tensors, json.loads(json.dumps(meta))))
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fresh.state[p][key], opt.state[p][key])


def test_fit_learns_and_interrupted_resume_is_exact(tmp_path) -> None:
    full, res = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(), tmp_path / "a", TOK.pad_token_id)
    assert res.epochs == 2 and res.stopped == "epochs" and res.steps == 2 * ((len(TRAIN) + 7) // 8)
    assert res.history[-1]["valid_loss"] < res.history[0]["valid_loss"] or res.history[0]["valid_loss"] < 7
    assert (tmp_path / "a" / "last" / "optimizer.safetensors").is_file()
    assert not list((tmp_path / "a").rglob("*.bin")) and not list((tmp_path / "a").rglob("*.pt"))

    # stop after the first optimizer step (a zero budget), then resume: same weights as the straight run
    _, cut = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(max_minutes=0.0), tmp_path / "b",
                           TOK.pad_token_id)
    assert cut.stopped == "max_minutes" and cut.steps == 1
    state = json.loads((tmp_path / "b" / "last" / "state.json").read_text())["state"]
    assert (state["epoch"], state["batch"]) == (0, 1)
    resumed, res2 = fit_causal_lm(new_model("tiny", TOK, seed=5), TRAIN, VALID, cfg(resume=True), tmp_path / "b",
                                  TOK.pad_token_id)
    assert res2.steps == res.steps
    # "best" = lowest valid loss; the straight run's last epoch is its best here, so compare last weights
    final_a = json.loads((tmp_path / "a" / "last" / "state.json").read_text())
    final_b = json.loads((tmp_path / "b" / "last" / "state.json").read_text())
    assert final_a["scheduler"]["last_epoch"] == final_b["scheduler"]["last_epoch"]
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "last" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "last" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_early_stopping_on_evaluator_metric_keeps_best(tmp_path) -> None:
    scores = iter([0.30, 0.20, 0.10, 0.05])
    snapshots = []

    def evaluator(model) -> dict[str, float]:
        snapshots.append(weights(model))
        return {"recall@10": next(scores), "ndcg@10": 0.0}

    best, res = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(epochs=4, patience=2),
                              tmp_path, TOK.pad_token_id, evaluator=evaluator)
    assert res.stopped == "patience" and res.epochs == 3 and res.best_epoch == 1
    assert res.score_name == "recall@10" and res.best_score == pytest.approx(0.30)
    for k, v in weights(best).items():  # the returned model holds epoch 1's weights
        torch.testing.assert_close(v, snapshots[0][k])


def test_epochs_in_budget_arithmetic() -> None:
    from training.target_lm.budget import epochs_in_budget

    assert epochs_in_budget(budget_s=3300, spent_s=60, epoch_s=600, eval_s=30, max_epochs=8) == 5
    assert epochs_in_budget(budget_s=100, spent_s=60, epoch_s=600, eval_s=30, max_epochs=8) == 1  # at least one
    assert epochs_in_budget(budget_s=1e6, spent_s=0, epoch_s=60, eval_s=5, max_epochs=6) == 6  # capped


def test_fit_budget_sizes_the_schedule_and_resume_keeps_it(tmp_path) -> None:
    import time

    from training.target_lm.train import _saved_budget_plan

    calls = []

    def slow_evaluator(model) -> dict[str, float]:  # 1 s per validation pass: at most 3 fit in 3.5 s
        calls.append(1)
        time.sleep(1.0)
        return {"recall@10": 0.1 * len(calls), "ndcg@10": 0.0}

    budget = cfg(epochs=10, fit_budget=True, max_minutes=3.5 / 60)
    _, res = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, budget, tmp_path, TOK.pad_token_id,
                           evaluator=slow_evaluator)
    plan = res.budget_plan
    assert plan is not None and plan["eval_seconds"] >= 1.0 and plan["train_tokens_per_s"] > 0
    assert plan["other_cores"] is not None and plan["other_cores"] >= 0.0  # recorded (Linux)
    assert 1 <= res.schedule_epochs == plan["epochs"] <= 3 < budget.epochs
    steps_per_epoch = (len(TRAIN) + 7) // 8
    if res.stopped == "epochs":  # the whole (shortened) schedule ran: the learning rate ended annealed
        assert res.epochs == res.schedule_epochs and res.steps == steps_per_epoch * res.schedule_epochs
        sched = json.loads((tmp_path / "last" / "state.json").read_text())["scheduler"]
        assert max(sched["_last_lr"]) == pytest.approx(0.0, abs=1e-9)
    assert _saved_budget_plan(tmp_path) == plan
    calls.clear()
    _, again = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(**{**budget.__dict__, "resume": True}),
                             tmp_path, TOK.pad_token_id, evaluator=slow_evaluator)
    assert again.budget_plan == plan and again.schedule_epochs == res.schedule_epochs
    if res.stopped == "epochs":
        assert calls == []  # nothing re-timed, nothing re-trained


def test_fit_budget_needs_a_budget(tmp_path) -> None:
    with pytest.raises(Exception, match="--max-minutes"):
        fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(fit_budget=True), tmp_path,
                      TOK.pad_token_id)


def test_the_plan_records_other_processes_cpu_use_and_warns_when_they_contend() -> None:
    """``other_cores``: the machine's busy CPU seconds minus this process's, over the wall time; a plan made while
    other processes kept at least ``CONTENDED_CORES`` busy gets a warning line (the probe then times epochs slow)."""
    from training.target_lm.budget import CONTENDED_CORES, contention_warning, cpu_seconds, other_cores

    assert other_cores((100.0, 10.0), (103.0, 11.0), 2.0) == 1.0
    assert other_cores((100.0, 10.0), (100.5, 11.0), 1.0) == 0.0  # never negative (tick rounding)
    assert other_cores(None, (1.0, 1.0), 1.0) is None and other_cores((1.0, 1.0), (2.0, 1.0), 0.0) is None
    now = cpu_seconds()
    assert now is not None and now[0] > 0 and now[1] >= 0  # Linux: /proc/stat
    assert contention_warning({"other_cores": CONTENDED_CORES - 0.01}) is None
    assert contention_warning({"other_cores": None}) is None and contention_warning(None) is None
    warning = contention_warning({"other_cores": 1.0})
    assert warning is not None and "1.0 core(s)" in warning and "idle machine" in warning


# the keys of a checkpoint's state.json "state" as the loop wrote them when it kept its state in a dict
STATE_KEYS = {"epoch", "batch", "step", "best_score", "best_epoch", "bad_epochs", "history", "train_seconds",
              "train_tokens", "budget_plan", "schedule_epochs", "scores", "lrs"}


def test_the_checkpoints_state_keeps_its_format_and_an_older_one_resumes(tmp_path) -> None:
    from training.target_lm.loop_state import LoopState

    _, cut = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(max_minutes=0.0), tmp_path / "b",
                           TOK.pad_token_id)
    path = tmp_path / "b" / "last" / "state.json"
    payload = json.loads(path.read_text())
    state = payload["state"]
    assert set(state) == STATE_KEYS and (state["epoch"], state["batch"], state["step"]) == (0, 1, 1)
    assert state["schedule_epochs"] == 2 and len(state["scores"]) == 1 and len(state["lrs"]) == 1
    # a checkpoint of the dict era without "lrs" (before the loop recorded them) resumes, and finishes the run
    del state["lrs"]
    path.write_text(json.dumps(payload, indent=1))
    loaded = LoopState.resumed(json.loads(path.read_text())["state"], LoopState(schedule_epochs=2), path.parent)
    assert (loaded.epoch, loaded.batch, loaded.step, loaded.lrs) == (0, 1, 1, [])
    _, res = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(resume=True), tmp_path / "b",
                           TOK.pad_token_id)
    assert res.epochs == 2 and res.steps == 2 * ((len(TRAIN) + 7) // 8)
    assert set(json.loads(path.read_text())["state"]) == STATE_KEYS
    # one without per-user scores is refused with a message
    del state["scores"]
    path.write_text(json.dumps(payload))
    from recsvc.errors import UserError

    with pytest.raises(UserError, match="--force"):
        fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(resume=True), tmp_path / "b",
                      TOK.pad_token_id)
