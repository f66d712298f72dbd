"""Choosing the epoch: the within-one-standard-error rule on per-user scores, its record in the loop, and the
scratch refit trained under the selection run's schedule (stopped at the chosen epoch)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_train_fixtures import one_thread, random_ids, small_tokenizer  # noqa: F401 (one_thread: a fixture)
from test_train_loop import TOK, TRAIN, VALID, cfg

from recsvc.bundle.presets import new_model
from recsvc.data.metrics import evaluate_rankings, standard_error
from recsvc.data.split import EvalUser
from training.target_lm.selection import (
    PER_USER,
    mean_se,
    paired_difference,
    per_user_metrics,
    select_epoch,
    selection_table,
)
from training.target_lm.train import cosine_schedule, fit_causal_lm, validation_loss, validation_losses

pytestmark = pytest.mark.usefixtures("one_thread")

N = 200  # synthetic validation users


def hits(ones: list[int]) -> list[float]:
    """Per-user Recall@10 of N users, 1 for the users in ``ones``."""
    out = [0.0] * N
    for u in ones:
        out[u] = 1.0
    return out


BASE = list(range(0, 60))  # 60 of 200 users hit: 0.30


def test_mean_and_paired_errors_match_the_textbook_formulas() -> None:
    a, b = hits(BASE), hits(BASE[:50] + [100, 101])
    mean, se = mean_se(a)
    assert mean == pytest.approx(0.30) and se == pytest.approx(standard_error(a))
    diff, dse = paired_difference(a, b, float(np.mean(a)), float(np.mean(b)))
    assert diff == pytest.approx(np.mean(a) - np.mean(b))
    assert dse == pytest.approx(standard_error([x - y for x, y in zip(a, b, strict=True)]))
    assert dse < standard_error(a)  # the same users: most of the spread between users cancels
    assert paired_difference(None, b, 0.3, 0.26) == (pytest.approx(0.04), 0.0)  # means only: no error known


def test_within_se_takes_the_later_epoch_within_noise_and_keeps_a_clear_win() -> None:
    e1 = hits(BASE[:30])  # clearly worse
    e2 = hits(BASE)  # the best
    e3 = hits(BASE[:57] + [150, 151])  # 3 users lost, 2 gained: 0.005 behind, within one paired error
    e4 = hits(BASE[:40])  # 20 users lost: clearly behind
    means = [float(np.mean(e)) for e in (e1, e2, e3, e4)]
    diff, se = np.mean(e2) - np.mean(e3), standard_error([x - y for x, y in zip(e2, e3, strict=True)])
    assert 0 < diff <= se  # the construction: epoch 3 is a noisy draw of epoch 2
    assert select_epoch(means, [e1, e2, e3, e4], "best") == 1
    assert select_epoch(means, [e1, e2, e3, e4], "within-se") == 2  # epoch 3, later and within noise
    # a clear win stays: nothing after the best epoch is within its error
    assert select_epoch(means[:2] + means[3:], [e1, e2, e4], "within-se") == 1
    # a tie (the same users hit) goes to the schedule's end, under both readings of "tie"
    assert select_epoch([0.3, 0.3], [e2, list(e2)], "within-se") == 1
    assert select_epoch([0.3, 0.3], [e2, list(e2)], "best") == 0
    assert select_epoch([0.3, 0.3], [None, None], "within-se") == 1  # no per-user values: ties go late
    # an earlier epoch within noise of a later best is not taken: the rule never walks back before the best
    assert select_epoch([0.295, 0.30], [e3, e2], "within-se") == 1
    with pytest.raises(ValueError, match="rule"):
        select_epoch(means, [e1, e2, e3, e4], "coin")


def test_selection_table_records_mean_se_and_paired_difference_to_the_best() -> None:
    e1, e2, e3 = hits(BASE[:30]), hits(BASE), hits(BASE[:57] + [150, 151])
    per_user = [e1, e2, e3]
    means = [float(np.mean(e)) for e in per_user]
    rows = selection_table([1.0, 2.0, 3.0], means, per_user, "within-se")
    assert [r["epoch"] for r in rows] == [1.0, 2.0, 3.0]
    assert [r["best"] for r in rows] == [False, True, False] and [r["chosen"] for r in rows] == [False, False, True]
    for r, e in zip(rows, per_user, strict=True):
        assert r["mean"] == pytest.approx(np.mean(e)) and r["se"] == pytest.approx(standard_error(e))
        assert r["vs_best"] == pytest.approx(np.mean(e) - np.mean(e2))
        assert r["vs_best_se"] == pytest.approx(standard_error([x - y for x, y in zip(e, e2, strict=True)]))
    assert rows[1]["vs_best"] == 0.0 and rows[1]["vs_best_se"] == 0.0


def test_per_user_metrics_average_to_evaluate_rankings() -> None:
    users = [EvalUser(1, [5], [7]), EvalUser(2, [5], [8, 9]), EvalUser(3, [6], [1]), EvalUser(4, [6], [])]
    rankings = {1: [7, 2, 3], 2: [3, 9, 8], 3: [2, 3, 4]}  # user 4 has no target: not scored
    values = per_user_metrics(rankings, users, k=2)
    ref = evaluate_rankings(rankings, users, (2,))
    assert len(values["recall@2"]) == 3
    assert np.mean(values["recall@2"]) == pytest.approx(ref["recall@2"])
    assert np.mean(values["ndcg@2"]) == pytest.approx(ref["ndcg@2"])


# ------------------------------------------------------------------------------------------ the training loop
# the training loop's tiny task (tests/test_train_loop.py): a catalog walked in steps of 1 or 2
def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_loop_keeps_the_later_epoch_within_noise_and_records_errors(tmp_path) -> None:
    scripted = [hits(BASE[:30]), hits(BASE), hits(BASE[:57] + [150, 151]), hits(BASE[:40])]
    snapshots = []
    calls = iter(scripted)

    def evaluator(model) -> dict:
        snapshots.append(weights(model))
        values = next(calls)
        return {"recall@10": float(np.mean(values)), "ndcg@10": 0.0, PER_USER: {"recall@10": values}}

    best, res = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(epochs=4, patience=1,
                              select="within-se"), tmp_path, TOK.pad_token_id, evaluator=evaluator)
    # epoch 3 is within one paired error of epoch 2: chosen; epoch 4 is clearly behind: patience 1 stops there
    assert res.best_epoch == 3 and res.stopped == "patience" and res.epochs == 4
    assert res.best_score == pytest.approx(np.mean(scripted[2]))
    for k, v in weights(best).items():  # the returned model holds epoch 3's weights
        torch.testing.assert_close(v, snapshots[2][k])
    # the record: each epoch's mean and error, and its paired difference to the best so far
    row = res.history[2]["selection"]
    assert row["se"] == pytest.approx(standard_error(scripted[2])) and row["chosen"]
    assert row["vs_best"] == pytest.approx(np.mean(scripted[2]) - np.mean(scripted[1]))
    assert row["vs_best_se"] == pytest.approx(
        standard_error([x - y for x, y in zip(scripted[2], scripted[1], strict=True)]))
    assert [r["chosen"] for r in res.selection] == [False, False, True, False]
    assert [r["best"] for r in res.selection] == [False, True, False, False]
    assert res.selection[0]["se"] == pytest.approx(standard_error(scripted[0]))
    # the per-user values are in the checkpoint: a resumed run can still pair epochs
    state = json.loads((tmp_path / "last" / "state.json").read_text())["state"]
    assert [s["per_user"] for s in state["scores"]] == scripted


def test_the_best_rule_keeps_the_old_behaviour(tmp_path) -> None:
    scripted = iter([hits(BASE[:30]), hits(BASE), hits(BASE[:57] + [150, 151])])

    def evaluator(model) -> dict:
        values = next(scripted)
        return {"recall@10": float(np.mean(values)), PER_USER: {"recall@10": values}}

    _, res = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(epochs=3, select="best"), tmp_path,
                           TOK.pad_token_id, evaluator=evaluator)
    assert res.best_epoch == 2 and [r["chosen"] for r in res.selection] == [False, True, False]


def test_loss_selection_pairs_each_examples_loss(tmp_path) -> None:
    model = new_model("tiny", TOK, seed=0)
    mean, each = validation_losses(model, VALID, TOK.pad_token_id, 4, torch.device("cpu"), False)
    assert len(each) == len(VALID) and mean == pytest.approx(validation_loss(model, VALID, TOK.pad_token_id, 3,
                                                                             torch.device("cpu"), False))
    # every validation example is labelled on one item's codes: equal counts, so the token mean is their mean
    assert mean == pytest.approx(float(np.mean(each)), rel=1e-5)
    _, res = fit_causal_lm(model, TRAIN, VALID, cfg(select="within-se"), tmp_path, TOK.pad_token_id)
    assert all(r["se"] is not None and r["se"] > 0 for r in res.selection)
    assert res.history[-1]["selection"]["se"] == pytest.approx(res.selection[-1]["se"])
    assert sum(r["chosen"] for r in res.selection) == 1


def test_a_truncated_run_follows_the_whole_schedule_step_for_step(tmp_path) -> None:
    """The scratch refit's schedule: the selection run's (3 epochs), stopped after the chosen epoch (2). Same
    learning rate at every step, so the same weights as the whole run after its second epoch; and a resumed
    truncated run gets there too (long refits resume)."""
    snapshots = []

    def evaluator(model) -> dict:
        snapshots.append(weights(model))
        return {"recall@10": 0.1}

    _, whole = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, VALID, cfg(epochs=3), tmp_path / "whole",
                             TOK.pad_token_id, evaluator=evaluator)
    # as the refit trains: no validation examples (the latest epoch is the one returned)
    cut, part = fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, [], cfg(epochs=3, stop_after=2),
                              tmp_path / "cut", TOK.pad_token_id)
    assert part.epochs == 2 and part.schedule_epochs == 3 and part.steps == 2 * whole.steps // 3
    assert part.lrs == whole.lrs[:2] and len(whole.lrs) == 3
    assert part.lrs[-1] > 0.1 * cfg().lr  # not annealed: the schedule goes on past the stop
    for k, v in weights(cut).items():
        torch.testing.assert_close(v, snapshots[1][k], rtol=0, atol=1e-6)
    # step for step: the learning rates of the truncated schedule are the whole one's first steps
    spe = whole.steps // 3
    lrs = []
    for epochs in (3, 2):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg().lr)
        sched = cosine_schedule(opt, spe, epochs, cfg().warmup)
        lrs.append([])
        for _ in range(2 * spe + 1):
            lrs[-1].append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
    # the loop records the learning rate after each epoch's last step: the whole schedule's at the same step
    assert part.lrs == pytest.approx([lrs[0][spe], lrs[0][2 * spe]])
    # a 2-epoch schedule (the old refit, squeezed into the chosen epochs) differs and anneals to 0 by its end
    assert lrs[1][2 * spe] == pytest.approx(0.0, abs=1e-12) and lrs[0][2 * spe] > 0.1 * cfg().lr

    # resumable: stop after epoch 1, then resume to epoch 2 of the same 3-epoch schedule
    fit_causal_lm(new_model("tiny", TOK, seed=0), TRAIN, [], cfg(epochs=3, stop_after=1), tmp_path / "r",
                  TOK.pad_token_id)
    resumed, again = fit_causal_lm(new_model("tiny", TOK, seed=7), TRAIN, [],
                                   cfg(epochs=3, stop_after=2, resume=True), tmp_path / "r", TOK.pad_token_id)
    assert again.epochs == 2 and again.steps == part.steps
    for k, v in weights(resumed).items():
        torch.testing.assert_close(v, snapshots[1][k], rtol=0, atol=1e-6)
