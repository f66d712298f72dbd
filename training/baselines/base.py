"""What every baseline shares: the fit periods of the two protocols and the ranking interface.

Protocols (the same for every baseline, and the same words as ``recsvc train target --protocol``):

- ``paper``: fitted on the TRAIN period only, for both splits (the AtSpeed / LC-Rec protocol).
- ``deploy``: for the test split, fitted on TRAIN + VALID (what a deployed model knows before the test
  period); for the valid split, on TRAIN only (the valid period is the target there).

Histories never change with the protocol: they are the loader's ``SplitData.eval_users(split)`` (valid:
train items; test: train + valid items). Only what the baseline was *fitted* on changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

from recsvc.data.split import EvalUser, SplitData
from recsvc.errors import UserError
from training.choices import FIT_PERIODS, PROTOCOLS

FitOn = Literal["train", "train+valid"]


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise UserError(f"unknown protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    return protocol


def check_fit_on(fit_on: str) -> str:
    if fit_on not in FIT_PERIODS:
        raise UserError(f"unknown fit period {fit_on!r}: expected one of {', '.join(FIT_PERIODS)}")
    return fit_on


def fit_period(protocol: str, split: str) -> str:
    """The periods a baseline is fitted on before it is evaluated on ``split``.

    >>> fit_period("paper", "test"), fit_period("deploy", "test"), fit_period("deploy", "valid")
    ('train', 'train+valid', 'train')
    """
    check_protocol(protocol)
    if split not in ("valid", "test"):
        raise UserError(f"unknown split {split!r}: expected valid or test")
    return "train+valid" if protocol == "deploy" and split == "test" else "train"


def fit_sequences(data: SplitData, fit_on: str) -> dict[int, list[int]]:
    """user_id -> the chronological items of the fit period (train, or train followed by valid)."""
    return data.sequences(check_fit_on(fit_on))


class Baseline(ABC):
    """A fitted baseline: ``rank(users, k, exclude_history) -> {user_id: [item_id, ...]}`` (best first).

    ``fit_on`` is the period it was fitted on; ``fit_seconds`` the wall time of the fit (set by
    :func:`training.baselines.registry.fit_baseline`); ``info`` extra facts for the JSON report.
    """

    name: str = ""
    fit_on: str = "train"
    fit_seconds: float = 0.0

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    @abstractmethod
    def rank(self, users: Sequence[EvalUser], k: int, exclude_history: bool = False) -> dict[int, list[int]]:
        """The top-``k`` items per user, optionally never one of the user's history items."""
