"""``training.tuning.studies.run_staged``: two stages of a search in one resumable study."""

from __future__ import annotations

import pytest

from training.tuning.studies import run_staged, study


def _objective(trial) -> float:
    x = trial.suggest_float("x", -2.0, 2.0)
    y = trial.suggest_float("y", -2.0, 2.0)
    return -((x - 1.0) ** 2) - (y + 0.5) ** 2


def test_first_stage_fixes_the_given_parameters_then_the_best_trials(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TQDM_DISABLE", "1")
    search = study(tmp_path / "s.db", "staged", seed=0, objective_key={"what": "quadratic"})
    assert run_staged(search, _objective, {"y": 2.0}, ("x",), trials=8, minutes=1.0) == 16
    first, second = search.trials[:8], search.trials[8:]
    assert {t.params["y"] for t in first} == {2.0}  # stage 1: y fixed as given, x searched
    best_x = max(first, key=lambda t: t.value).params["x"]
    assert all(t.params["x"] == pytest.approx(best_x) for t in second)  # stage 2: x fixed at stage 1's best
    assert len({t.params["y"] for t in second}) > 1 and search.best_value >= max(t.value for t in first)
    # resumed: both stages done, nothing runs; the study keeps its sampler for later use
    again = study(tmp_path / "s.db", "staged", seed=0, objective_key={"what": "quadratic"})
    assert run_staged(again, _objective, {"y": 2.0}, ("x",), trials=8, minutes=1.0) == 0
    assert len(again.trials) == 16
