"""Optuna studies shared by the ``recsvc tune`` searches: resumable (SQLite next to the bundle), bounded by a trial
count and a wall-clock budget, whichever comes first."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recsvc.errors import UserError
from recsvc.timeline.config import CONFIG_FILE as TIMELINE_CONFIG
from recsvc_base.progress import progress_bar, progress_mode

if TYPE_CHECKING:
    from recsvc.priors.transition import PriorSettings


def check_budget(trials: int, minutes: float) -> None:
    if trials < 1:
        raise UserError(f"--trials must be >= 1, got {trials}")
    if minutes <= 0:
        raise UserError(f"--budget-minutes must be > 0, got {minutes}")


def study(path: Path, name: str, seed: int, objective_key: dict[str, Any] | None = None):
    """The study ``name`` in the SQLite file ``path``, resumed when it exists. ``objective_key``: everything the
    trials' scores depend on besides the searched parameters (the model's weights, the validation users, the
    metric, the settings a search builds on); the study is named after its digest, so a run whose objective
    changed (a retrained target, a re-tuned transition prior, other users) starts a new study instead of
    resuming trials that were scored on another objective. The key is stored as a study attribute."""
    import optuna

    path.parent.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    text = json.dumps(objective_key, sort_keys=True, default=str) if objective_key is not None else None
    if text is not None:
        name = f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    created = optuna.create_study(study_name=name, storage=f"sqlite:///{path.resolve()}", direction="maximize",
                                  load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=seed))
    if text is not None and "objective" not in created.user_attrs:
        created.set_user_attr("objective", json.loads(text))
    return created


def files_fingerprint(directory: Path, pattern: str) -> dict[str, list[int]]:
    """The files of ``directory`` matching ``pattern`` by name -> [size, modification time in ns]: rewritten files
    change it (a copy does too, which only starts a fresh search), without reading them."""
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(Path(directory).glob(pattern))}


def weights_fingerprint(model_dir: Path) -> dict[str, list[int]]:
    """The weight files of a saved model (a retrained or replaced model changes it)."""
    return files_fingerprint(model_dir, "*.safetensors")


def run_trials(study, objective, trials: int, minutes: float) -> int:
    """Run up to ``trials`` more-than-finished trials within ``minutes``; returns the trials run now. Progress
    follows ``recsvc_base.progress``: Optuna's own bar on a terminal, else a plain line at most once a minute (or none
    with ``TQDM_DISABLE``), never a ``\\r`` redraw in a log file."""
    done = len([t for t in study.trials if t.state.name == "COMPLETE"])
    todo = max(0, trials - done)
    if not todo:
        return todo
    if progress_mode() == "bar":
        study.optimize(objective, n_trials=todo, timeout=minutes * 60, show_progress_bar=True)
        return todo
    bar = progress_bar(total=todo, desc=f"trials ({minutes:g} min budget)")

    def advance(search, trial) -> None:
        bar.update(1)
        if any(t.state.name == "COMPLETE" for t in search.trials):
            bar.set_postfix(best=f"{search.best_value:.5f}@{search.best_trial.number}", refresh=False)

    try:
        study.optimize(objective, n_trials=todo, timeout=minutes * 60, callbacks=[advance])
    finally:
        bar.close()
    return todo


def run_staged(search, objective, first: dict, then: tuple[str, ...], trials: int, minutes: float) -> int:
    """Two TPE stages of ``trials`` each in one study (``training.tuning.studies.run_trials``, resumable): the
    parameters ``first`` fixed at their values, then the parameters named ``then`` fixed at the best trial's. The
    study's best covers both stages, so it is never worse than the first alone; each stage searches fewer
    parameters (``recsvc tune mix``: all of a mixture's and the transition counts' at once found a worse prior
    ranking in as many trials on Beauty). Returns the trials run now."""
    import warnings

    from optuna.exceptions import ExperimentalWarning
    from optuna.samplers import PartialFixedSampler

    tpe = search.sampler

    def fixing(params: dict) -> PartialFixedSampler:
        with warnings.catch_warnings():  # optuna marks the sampler experimental (stable since 2.4)
            warnings.simplefilter("ignore", ExperimentalWarning)
            return PartialFixedSampler(params, tpe)

    search.sampler = fixing(first)
    ran = run_trials(search, objective, trials, minutes)
    search.sampler = fixing({k: search.best_trial.params[k] for k in then})
    ran += run_trials(search, objective, 2 * trials, minutes)
    search.sampler = tpe
    return ran


def suggest_transition(trial) -> PriorSettings:
    """A trial's transition counts settings: window, decay and back-off, the ranges ``recsvc tune prior`` and
    ``recsvc tune mix`` search (weight 0: each search sets its own)."""
    from recsvc.priors.transition import PriorSettings

    return PriorSettings(window=trial.suggest_int("window", 1, 5), decay=trial.suggest_float("decay", 0.05, 1.0),
                         beta=trial.suggest_float("beta", 0.01, 30.0, log=True))


def validation_model(bundle, what: str) -> tuple[str, Path]:
    """(protocol, the model directory a validation search must rank with): BUNDLE/target-train for a deploy
    bundle (its served target saw the valid period), BUNDLE/target otherwise; ``what`` names the search for the
    error when a deploy bundle has no train-only target."""
    train_only = bundle.train_only_target_dir
    has_train_only = (train_only / "config.json").is_file() or (train_only / TIMELINE_CONFIG).is_file()
    protocol = bundle.read().get("protocol") or ("deploy" if has_train_only else "paper")
    if protocol == "deploy" and not has_train_only:
        raise UserError(f"{bundle.root} has no train-only target (BUNDLE/target-train): its target saw the valid "
                        f"period, so validation cannot choose {what}")
    return protocol, (bundle.train_only_target_dir if protocol == "deploy" else bundle.target_dir)
