"""Today's models from yesterday's: nothing starts from nothing.

- The item-level target continues from yesterday's weights (the codes' vocabulary is fixed and known items keep
  their ids, so every tensor carries over) for a planned number of epochs on today's train period, at a lower
  learning rate, annealed over those epochs; no epoch is chosen (the gate scores the result).
- The transition prior is counted again over today's history with yesterday's chosen settings (counts are the
  data; nothing is learnt).
- The prior's SASRec (when the bundle mixes one) continues from yesterday's served weights for a planned number
  of epochs on today's train period at its own learning rate; its item table is yesterday's (items added since
  have no SASRec score, as in the live catalog).
- The fresh-item component keeps yesterday's settings and query; the live catalog's additions' vectors join it
  and the fresh set is recounted on today's history.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsvc.data.split import SplitData
from tokenizer_rqvae.ids import SemanticIds


@dataclass(frozen=True)
class ContinuePlan:
    """The budget of one refresh: epochs of each learnt model and their learning rates."""

    target_epochs: int = 2
    target_lr: float = 5e-4  # a quarter of the from-scratch schedule's peak (training.item_target.command)
    sasrec_epochs: int = 4  # chosen on the first replayed Beauty day's kept-aside items (docs/REFRESH.md)
    sasrec_lr_scale: float = 1.0
    batch_size: int = 128
    seed: int = 0
    bf16: bool = False


def continue_target(yesterday_target: Path, data: SplitData, ids: SemanticIds, out: Path,
                    plan: ContinuePlan) -> dict[str, Any]:
    """Yesterday's item-level target trained ``plan.target_epochs`` more on ``data``'s train period -> ``out``
    (a TimelineModel directory with training.json; resumes from its checkpoint)."""
    from recsvc.timeline.config import TimelineConfig
    from training.item_target.train import ItemTrainConfig, train_item_target

    model_config = TimelineConfig.from_json(json.loads((yesterday_target / "timeline.json").read_text()))
    config = ItemTrainConfig(epochs=plan.target_epochs, batch_size=plan.batch_size, lr=plan.target_lr,
                             seed=plan.seed, patience=0, bf16=plan.bf16, fit_periods="train", validate=False,
                             init=str(yesterday_target.resolve()))
    record = train_item_target(data, ids, model_config, config, out)
    return {"epochs": len(record["epochs"]), "seconds": record["seconds"], "windows": record["windows"],
            "loss": record["epochs"][-1]["loss"] if record["epochs"] else None}


def continue_prior(yesterday_prior: Path, data: SplitData, ids: SemanticIds, out: Path,
                   plan: ContinuePlan) -> dict[str, Any]:
    """BUNDLE/prior (or prior-excl) for today: the transition counted on train + valid with yesterday's settings
    (the served prior; the gate counts it on train, ``--protocol paper``), and the SASRec of a mixed prior
    continued on train, stored as both the served and the train-period one."""
    from recsvc.priors.mixed import MIX_FILE, SEQUENCE_DIR
    from recsvc.priors.transition import TransitionPrior

    settings = TransitionPrior.load(yesterday_prior).settings
    items = ids.item_ids.tolist()
    TransitionPrior.fit(data.sequences("train+valid").values(), items, settings, fitted_on="train+valid").save(out)
    info: dict[str, Any] = {"transition": "counted on train+valid"}
    seq_dir = yesterday_prior / SEQUENCE_DIR
    if (seq_dir / MIX_FILE).is_file():
        info["sasrec"] = _continue_sasrec(seq_dir, data, out, plan)
        shutil.copy2(seq_dir / MIX_FILE, out / SEQUENCE_DIR / MIX_FILE)
    return info


def _continue_sasrec(seq_dir: Path, data: SplitData, out: Path, plan: ContinuePlan) -> dict[str, Any]:
    import torch

    from training.baselines.sasrec import SASRecBaseline
    from training.baselines.sasrec_train import train_sasrec

    sasrec = SASRecBaseline.load(seq_dir)
    row = {int(i): r + 1 for r, i in enumerate(sasrec.item_ids.tolist())}  # item -> row 1..n (0: padding)
    rows = [[row[i] for i in seq if i in row] for seq in data.sequences("train").values()]
    gen = torch.Generator().manual_seed(plan.seed)
    log = train_sasrec(sasrec.model, rows, sasrec.settings, plan.sasrec_epochs, gen=gen, progress=False,
                       lr=sasrec.settings.lr * plan.sasrec_lr_scale)
    sasrec.model.eval()
    for name in ("sequence", "sequence-train"):
        sasrec.save(out / name)
    return {"epochs": log.epochs, "seconds": log.seconds}


def refresh_fresh(yesterday_fresh: Path, data: SplitData, ids: SemanticIds, out: Path,
                  added: tuple[list[int], Any] | None = None) -> dict[str, Any]:
    """BUNDLE/fresh for today: yesterday's item vectors plus the live catalog's additions' (``added``: their
    item ids and vectors [m, d]), the fresh set recounted (the catalog's items nobody interacted with in today's
    train + valid), yesterday's settings and learned query."""
    import numpy as np

    from recsvc.content.fresh import FreshItems, ItemVectors, fresh_items_of

    old = FreshItems.load(yesterday_fresh, period="train+valid")
    vectors = old.vectors
    if added is not None and len(added[0]) and added[1].shape[1] == vectors.vectors.shape[1]:
        keep = ~np.isin(np.asarray(added[0]), vectors.item_ids)
        vectors = ItemVectors.from_arrays([*vectors.item_ids.tolist(), *np.asarray(added[0])[keep].tolist()],
                                          np.concatenate([vectors.vectors, added[1][keep]]))
    seen = [i for seq in data.sequences("train+valid").values() for i in seq]
    catalog = [i for i in ids.item_ids.tolist() if len(vectors.rows([i])) and vectors.rows([i])[0] >= 0]
    fresh = fresh_items_of(catalog, seen)
    FreshItems(vectors, fresh, old.settings, "train+valid", old.query).save(out)
    return {"fresh_items": len(fresh), "vectors": len(vectors.item_ids), "before": len(old)}
