"""The causal-LM training loop's state (``training.target_lm.train.fit_causal_lm``): where it stands and what it has
recorded, as one typed object.

A checkpoint saves it as the "state" object of ``DIR/state.json`` (``to_json``: one key per field, the format
checkpoints have always had) and a resumed run reads it back (``resumed``: a field an older checkpoint lacks keeps
the fresh run's value; a checkpoint without per-user scores cannot be resumed).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsvc.errors import UserError


@dataclass
class LoopState:
    schedule_epochs: int  # the epochs the learning-rate schedule spans (kept by a resumed run)
    budget_plan: dict[str, Any] | None = None  # --fit-budget's plan (training.target_lm.budget.plan_schedule), or None
    epoch: int = 0  # epochs finished
    batch: int = 0  # batches of the current epoch done (0 at an epoch's start)
    step: int = 0  # optimizer steps taken
    best_score: float = -math.inf  # the chosen evaluation's score (higher is better)
    best_epoch: int = -1  # its epoch (1-based; -1: none yet)
    bad_epochs: int = 0  # finished epochs since the last chosen one (--patience)
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per evaluation (epoch, losses, metrics)
    train_seconds: float = 0.0
    train_tokens: int = 0
    scores: list[dict[str, Any]] = field(default_factory=list)  # per evaluation: epoch, score, per-user scores
    lrs: list[float] = field(default_factory=list)  # the learning rate after each evaluated step

    def to_json(self) -> dict[str, Any]:
        """The "state" object of a checkpoint's state.json."""
        return dataclasses.asdict(self)

    @classmethod
    def resumed(cls, saved: dict[str, Any], fresh: LoopState, where: Path) -> LoopState:
        """The state a checkpoint saved (``saved``: its state.json "state"), fields it lacks taken from ``fresh``.

            >>> s = LoopState.resumed({"epoch": 2, "batch": 0, "step": 8, "scores": []}, LoopState(4), Path("ckpt"))
            >>> (s.epoch, s.step, s.schedule_epochs, s.lrs)
            (2, 8, 4, [])
        """
        if "scores" not in saved:
            raise UserError(f"{where} was written before checkpoints kept per-user scores and cannot be resumed: "
                            "pass --force to start over")
        known = {f.name for f in dataclasses.fields(cls)}
        return dataclasses.replace(fresh, **{k: v for k, v in saved.items() if k in known})

    def elapsed_epochs(self, n_batches: int) -> float:
        """Epochs trained so far, fractional within the current one."""
        return self.epoch + self.batch / n_batches
