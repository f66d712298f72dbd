"""The baselines by name: ``fit_baseline(name, data, fit_on) -> Baseline`` (a ranker with ``rank``)."""

from __future__ import annotations

import time
from pathlib import Path

from recsvc.data.split import SplitData
from recsvc.errors import UserError
from training.baselines.base import Baseline, check_fit_on

BASELINES: tuple[str, ...] = ("popularity", "transition", "transition-window", "sasrec")
DEFAULT_BASELINES: tuple[str, ...] = ("popularity", "transition", "transition-window")  # sasrec costs minutes


def parse_baselines(text: str) -> tuple[str, ...]:
    """``"popularity,sasrec"`` -> ("popularity", "sasrec") (order kept, duplicates dropped); "" or "none" -> ().

    >>> parse_baselines("transition, popularity,transition")
    ('transition', 'popularity')
    """
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["none"]:
        return ()
    unknown = [x for x in names if x not in BASELINES]
    if unknown:
        raise UserError(f"unknown baseline {unknown[0]!r}: expected a comma-separated subset of "
                        f"{','.join(BASELINES)} (or none)")
    return tuple(dict.fromkeys(names))


def fit_baseline(name: str, data: SplitData, fit_on: str = "train", *, sasrec_settings=None,
                 cache_dir: str | Path | None = None, progress: bool = True) -> Baseline:
    """Fit the baseline ``name`` on the ``fit_on`` period ("train" or "train+valid") of ``data``.

    ``sasrec_settings`` (a ``SASRecSettings``) and ``cache_dir`` (fitted weights are saved there and reused)
    only concern "sasrec". ``fit_seconds`` on the result: the fit's wall time, except for SASRec: its training
    seconds (selection + refit for train+valid) as recorded when it was trained, also when this call loaded it
    (or its selection fit) from the cache; ``info["wall_seconds"]`` then holds this call's wall time.
    """
    check_fit_on(fit_on)
    start = time.perf_counter()
    baseline: Baseline
    if name == "popularity":
        from training.baselines.popularity import PopularityBaseline

        baseline = PopularityBaseline.fit(data, fit_on)
    elif name in ("transition", "transition-window"):
        from training.baselines.transition import TransitionBaseline

        baseline = TransitionBaseline.fit(name, data, fit_on)
    elif name == "sasrec":
        from training.baselines.sasrec import fit_sasrec

        baseline = fit_sasrec(data, fit_on, sasrec_settings, cache_dir, progress)
    else:
        raise UserError(f"unknown baseline {name!r}: expected one of {', '.join(BASELINES)}")
    wall = time.perf_counter() - start
    baseline.fit_seconds = float(baseline.info.get("fit_seconds", wall))
    if name == "sasrec":
        baseline.info["wall_seconds"] = round(wall, 2)
    return baseline
