"""Baselines beside the model (training/baselines): transition counts by hand, protocol fit periods, SASRec
(learns a deterministic pattern, seeded, safetensors round trip, cache), and `recsvc eval --baselines-only`."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_commands import only_commands
from test_train_fixtures import make_data, one_thread  # noqa: F401 (one_thread: a fixture)

import recsvc.cli.main as cli
from recsvc.data.split import EvalUser, ItemMeta, SplitData
from training.baselines import BASELINES, fit_baseline, fit_period, fit_sequences
from training.baselines.registry import parse_baselines
from training.baselines.sasrec import SASRecBaseline, cache_dir_for, fit_sasrec
from training.baselines.sasrec_train import SASRecSettings
from training.evaluation.baselines import evaluate_baselines

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = SASRecSettings(hidden=32, blocks=1, heads=1, dropout=0.1, max_len=10, lr=5e-3, batch_size=32,
                      max_epochs=15, eval_every=3, patience=2, max_minutes=1.0, seed=0)


def split_data(train: dict[int, list[int]], valid: dict[int, list[int]] | None = None,
               test: dict[int, list[int]] | None = None, n_items: int = 3) -> SplitData:
    valid = {u: (valid or {}).get(u, []) for u in train}
    test = {u: (test or {}).get(u, []) for u in train}
    items = {i: ItemMeta(asin=f"I{i}") for i in range(1, n_items + 1)}
    return SplitData(root=Path("."), train=train, valid=valid, test=test, items=items)


def chain_data(n_items: int = 20, n_users: int = 150, seed: int = 0) -> SplitData:
    """Item i is always followed by i + 1 (cyclically): train = all but the last two, valid / test one each."""
    rng = random.Random(seed)
    train, valid, test = {}, {}, {}
    for u in range(1, n_users + 1):
        start, length = rng.randrange(n_items), rng.randint(5, 10)
        seq = [(start + t) % n_items + 1 for t in range(length)]
        train[u], valid[u], test[u] = seq[:-2], [seq[-2]], [seq[-1]]
    return split_data(train, valid, test, n_items)


def user(history: list[int], uid: int = 1) -> EvalUser:
    return EvalUser(user_id=uid, history=history, targets=[1])


# ---- transition ------------------------------------------------------------------------------------------------
def test_transition_counts_by_hand() -> None:
    """Sequences [1, 2], [1, 2], [1, 3]: count(1->2) = 2, count(1->3) = 1; counts 1: 3, 2: 2, 3: 1.

    pop = (count + 1) / (6 + 3) = [4, 3, 2] / 9; beta = 1:
    P(j | [1]) = (count(1 -> j) + pop(j)) / (3 + 1) = [4/9, 2 + 3/9, 1 + 2/9] / 4 = [4, 21, 11] / 36.
    """
    data = split_data({1: [1, 2], 2: [1, 2], 3: [1, 3]})
    base = fit_baseline("transition", data, "train")
    p = base.prior.probs([[1]])[0]
    assert p.tolist() == pytest.approx([4 / 36, 21 / 36, 11 / 36], rel=1e-6)
    assert base.rank([user([1])], 3) == {1: [2, 3, 1]}
    assert base.rank([user([1])], 3, exclude_history=True) == {1: [2, 3]}
    # an item with no outgoing transition (2 ends every sequence) backs off to popularity
    assert base.prior.probs([[2]])[0].tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9], rel=1e-6)


def test_transition_window_decay_formula() -> None:
    """transition-window: W = 3, d = 0.3, beta = 0.3; history [3, 2, 1] (1 is the last item).

    P = (P_1(.|1) + 0.3 P_1(.|2) + 0.09 P_1(.|3)) / 1.39; 2 and 3 have no outgoing pair, so P_1(.|2) = P_1(.|3)
    = pop; P_1(j|1) = (count(1 -> j) + 0.3 pop(j)) / 3.3.
    """
    data = split_data({1: [1, 2], 2: [1, 2], 3: [1, 3]})
    base = fit_baseline("transition-window", data, "train")
    s = base.prior.settings
    assert (s.window, s.decay, s.beta) == (3, 0.3, 0.3)
    pop = [4 / 9, 3 / 9, 2 / 9]
    after_1 = [(c + 0.3 * q) / 3.3 for c, q in zip([0, 2, 1], pop, strict=True)]
    expected = [(a + 0.3 * q + 0.09 * q) / 1.39 for a, q in zip(after_1, pop, strict=True)]
    assert base.prior.probs([[3, 2, 1]])[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert sum(expected) == pytest.approx(1.0)
    # only the last three items vote: a fourth one further back changes nothing
    assert base.prior.probs([[1, 3, 2, 1]])[0].tolist() == pytest.approx(expected, rel=1e-5)


# ---- protocols -------------------------------------------------------------------------------------------------
def test_protocol_fit_periods() -> None:
    assert fit_period("paper", "test") == "train" and fit_period("paper", "valid") == "train"
    assert fit_period("deploy", "test") == "train+valid" and fit_period("deploy", "valid") == "train"
    # the pair 2 -> 3 and item 3 exist only in the valid period
    data = split_data({1: [1, 2], 2: [1, 2], 3: [1, 2]}, valid={1: [3], 2: [3]}, test={3: [3]})
    assert fit_sequences(data, "train+valid")[1] == [1, 2, 3]
    assert fit_sequences(data, "train")[1] == [1, 2]

    paper = fit_baseline("transition", data, fit_period("paper", "test"))
    deploy = fit_baseline("transition", data, fit_period("deploy", "test"))
    assert paper.rank([user([1, 2])], 1) == {1: [1]}  # 2 ends every train sequence: popularity (tie: lower id)
    assert deploy.rank([user([1, 2])], 1) == {1: [3]}
    pop_paper = fit_baseline("popularity", data, "train")
    pop_deploy = fit_baseline("popularity", data, "train+valid")
    assert 3 not in pop_paper.counts and pop_deploy.counts == {1: 3, 2: 3, 3: 2}

    users = data.eval_users("test")  # history = train + valid under both protocols
    assert [(u.user_id, u.history) for u in users] == [(3, [1, 2])]
    for protocol, fit_on, recall in (("paper", "train", 0.0), ("deploy", "train+valid", 1.0)):
        out = evaluate_baselines(data, "test", (1,), ("transition", "popularity"), protocol, users)
        assert out["protocol"] == protocol
        assert {r["fit_on"] for r in out["baselines"].values()} == {fit_on}
        assert out["baselines"]["transition"]["recall@1"] == recall
    valid = evaluate_baselines(data, "valid", (1,), ("transition",), "deploy")
    assert valid["baselines"]["transition"]["fit_on"] == "train"


def test_parse_baselines() -> None:
    assert parse_baselines(",".join(BASELINES)) == BASELINES
    assert parse_baselines("none") == () and parse_baselines("") == ()
    from recsvc.errors import UserError

    with pytest.raises(UserError, match="unknown baseline 'bpr'"):
        parse_baselines("popularity,bpr")


# ---- SASRec ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain() -> tuple[SplitData, SASRecBaseline]:
    torch.set_num_threads(1)
    data = chain_data()
    return data, fit_sasrec(data, "train", TINY, progress=False)


def test_sasrec_learns_a_deterministic_pattern(chain) -> None:
    data, model = chain
    users = data.eval_users("test")
    top1 = model.rank(users, 1)
    right = sum(top1[u.user_id] == [u.history[-1] % 20 + 1] for u in users)
    assert right >= 0.9 * len(users), (right, len(users), model.info)
    assert model.info["best_epoch"] >= 1 and model.info["valid_ndcg@10"] > 0.8
    # excluding the history never returns a history item; k is respected
    ranked = model.rank(users[:5], 25, exclude_history=True)
    for u in users[:5]:
        assert len(ranked[u.user_id]) == 20 - len(set(u.history)) and not set(ranked[u.user_id]) & set(u.history)


def test_sasrec_save_load_identical_scores(chain, tmp_path) -> None:
    data, model = chain
    histories = [u.history for u in data.eval_users("test")]
    loaded = SASRecBaseline.load(model.save(tmp_path / "m"))
    assert torch.equal(model.scores(histories), loaded.scores(histories))
    assert loaded.settings == model.settings and loaded.fit_on == "train"
    assert not list((tmp_path / "m").glob("*.pt")) and not list((tmp_path / "m").glob("*.bin"))


def test_sasrec_seeded_and_cached(chain, tmp_path) -> None:
    data, model = chain
    histories = [u.history for u in data.eval_users("test")]
    again = fit_sasrec(data, "train", TINY, cache_dir=tmp_path, progress=False)
    assert torch.equal(model.scores(histories), again.scores(histories))  # same seed -> same weights
    assert again.info["cached"] is False and len(list(tmp_path.glob("sasrec-train-*"))) == 1
    cached = fit_baseline("sasrec", data, "train", sasrec_settings=TINY, cache_dir=tmp_path, progress=False)
    assert cached.info["cached"] is True and torch.equal(cached.scores(histories), model.scores(histories))
    assert cached.fit_seconds == pytest.approx(again.info["fit_seconds"]) and cached.info["wall_seconds"] >= 0
    other = fit_sasrec(data, "train", replace(TINY, seed=1, max_epochs=5), progress=False)
    assert not torch.equal(other.scores(histories), model.scores(histories))


def test_sasrec_time_budget_stops_and_keeps_an_evaluated_model(chain) -> None:
    data, _ = chain
    fit = fit_sasrec(data, "train", replace(TINY, max_minutes=1e-5), progress=False)
    assert fit.info["stopped"] == "budget" and fit.info["epochs"] == 1 and fit.info["best_epoch"] == 1
    assert fit.info["valid_ndcg@10"] is not None
    from recsvc.errors import UserError

    with pytest.raises(UserError, match="refit must be continue or scratch"):
        fit_sasrec(data, "train+valid", replace(TINY, refit="warm"), progress=False)


def test_sasrec_deploy_refits_on_train_and_valid(chain, tmp_path) -> None:
    data, selected = chain
    selected.save(cache_dir_for(tmp_path, data, "train", TINY))  # the selection fit is reused from the cache
    histories = [u.history for u in data.eval_users("test")]
    fit = fit_sasrec(data, "train+valid", replace(TINY, refit="continue"), cache_dir=tmp_path, progress=False)
    assert fit.fit_on == "train+valid" and fit.info["refit"] == "continue" and fit.info["epochs"] == 1
    assert fit.info["selection"]["best_epoch"] == selected.info["best_epoch"] and fit.info["lr"] == TINY.lr / 2
    assert not torch.equal(fit.scores(histories), selected.scores(histories))  # it trained on more
    assert len(list(tmp_path.glob("sasrec-train-*"))) == 1 and len(list(tmp_path.glob("sasrec-train_valid-*"))) == 1
    # the refit saw the valid items: their counts are in its popularity fallback
    assert fit.item_counts.sum().item() == sum(len(s) for s in fit_sequences(data, "train+valid").values())
    scratch = fit_sasrec(data, "train+valid", TINY, cache_dir=tmp_path, progress=False)  # the default
    assert scratch.info["epochs"] == selected.info["best_epoch"] and scratch.info["refit"] == "scratch"
    assert scratch.info["selection_cached"] is True
    users = data.eval_users("test")
    right = sum(scratch.rank(users, 1)[u.user_id] == [u.history[-1] % 20 + 1] for u in users)
    assert right >= 0.9 * len(users)


# ---- CLI -------------------------------------------------------------------------------------------------------
@pytest.fixture
def run_cli(monkeypatch):
    only_commands(monkeypatch, "eval")
    return cli.main


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("baselines"), n_users=80)


def test_cli_baselines_only_writes_every_baseline(run_cli, synth, tmp_path, capsys) -> None:
    out = tmp_path / "b.json"
    argv = ["eval", "--baselines-only", "--data", str(synth), "--split", "test", "--k", "5,10",
            "--baselines", ",".join(BASELINES), "--protocol", "deploy", "--cache-dir", str(tmp_path / "cache"),
            "--sasrec-max-minutes", "0.02", "--json", str(out)]
    assert run_cli(argv) == 0
    res = json.loads(out.read_text())
    assert res["protocol"] == "deploy" and list(res["baselines"]) == list(BASELINES)
    for r in res["baselines"].values():
        assert r["fit_on"] == "train+valid" and r["fit_seconds"] >= 0
        assert {"recall@5", "ndcg@5", "recall@10", "ndcg@10"} <= set(r) and 0 <= r["recall@10"] <= 1
    assert res["baselines"]["sasrec"]["info"]["selection"]["best_epoch"] >= 1
    table = capsys.readouterr().out
    assert "| sasrec | train+valid |" in table and "Recall@10" in table
    # a second run reuses the fitted SASRec; paper fits on train only
    argv[argv.index("deploy")] = "paper"
    assert run_cli(argv) == 0
    res = json.loads(out.read_text())
    assert res["baselines"]["sasrec"]["info"]["cached"] is True
    assert {r["fit_on"] for r in res["baselines"].values()} == {"train"}


@pytest.mark.parametrize("argv, message", [
    (["--baselines-only", "--baselines", "popularity,bpr"], "unknown baseline 'bpr'"),
    (["--baselines-only"], "--baselines-only needs --data"),
    (["--baselines-only", "--baselines", "none"], "at least one baseline"),
    ([], "--bundle is required"),
    (["--baselines-only", "--sasrec-max-minutes", "0"], "--sasrec-max-minutes must be > 0"),
])
def test_cli_user_errors(run_cli, argv, message, capsys) -> None:
    assert run_cli(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
