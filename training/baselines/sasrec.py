"""SASRec as a baseline: fit (seeded, early-stopped, time-bounded), rank, save / load, cache.

Ranking: score(j | h) = <h_last, E[j]> for all n catalog items (``recsvc.priors.sasrec``), optionally with the
user's history items removed, top-k. Items are mapped to rows 1..n in ascending item-id order; a history of
only unknown items (none on the loader's data) falls back to the fit-period popularity.

Fit periods (see ``base``):

- ``train``: trained on the train sequences; every ``eval_every`` epochs the valid NDCG@10 (history = train,
  targets = valid) is measured and the best epoch's weights are kept (early stopping, ``patience``).
- ``train+valid`` (the deploy protocol's test fit): first the ``train`` fit above (its own result, cached,
  is reused) selects the epoch count E on valid; then, no selection any more (the valid period is training
  data now), over the train + valid sequences:
  ``refit="scratch"`` (default): a fresh model with the same seed is trained for exactly E epochs (the
  textbook refit; it has its own ``max_minutes`` budget and records ``stopped == "budget"`` if that ends
  first). On Beauty: selection 11 epochs (best 8) ~6.5 min, refit 8 epochs ~5-6 min on one CPU thread.
  ``refit="continue"``: the selected weights continue for ``refit_epochs`` (1) at lr * ``refit_lr_scale``
  (0.5), what ``recsvc train target --protocol deploy`` does with the target: one epoch (~35 s) instead of
  E, but measurably weaker (Beauty test Recall@10 0.0138 vs 0.0222 from scratch).

Cache: ``CACHE/sasrec-<train or train_valid>-<key>/`` holds ``model.safetensors`` (weights, item ids and counts; never a
pickle) and ``fit.json`` (settings, fit log). ``key`` hashes the settings, the fit period and the train and
valid sequences, so a second ``recsvc eval`` on the same data and settings loads instead of training.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from recsvc.data.split import EvalUser, SplitData
from recsvc.errors import UserError
from recsvc.priors.sasrec import SASRec
from training.baselines.base import Baseline, check_fit_on, fit_sequences
from training.baselines.sasrec_train import SASRecSettings, TrainLog, train_sasrec

MODEL_FILE = "model.safetensors"
FIT_FILE = "fit.json"
CACHE_VERSION = 1
SCORE_BATCH = 256  # users per [B, n] score block


class SASRecBaseline(Baseline):
    name = "sasrec"

    def __init__(self, model: SASRec, item_ids: torch.Tensor, item_counts: torch.Tensor, settings: SASRecSettings,
                 fit_on: str = "train", info: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.model = model.eval()
        self.item_ids = item_ids.long()  # [n] item id of row r + 1, ascending
        self.item_counts = item_counts.float()  # [n] fit-period interactions (popularity fallback)
        self.settings = settings
        self.fit_on = check_fit_on(fit_on)
        self.info = dict(info or {})
        self._row = {int(i): r + 1 for r, i in enumerate(self.item_ids.tolist())}  # item id -> row 1..n

    # ---- scoring ----------------------------------------------------------------------------------------------
    def rows(self, history: Sequence[int]) -> list[int]:
        """The last ``max_len`` known items of a history as rows 1..n (unknown items dropped)."""
        rows = [self._row[int(i)] for i in history if int(i) in self._row]
        return rows[-self.settings.max_len:]

    @torch.inference_mode()
    def scores(self, histories: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B] histories -> [B, n] scores (columns in ``item_ids`` order)."""
        rows = [self.rows(h) for h in histories]
        lengths = torch.tensor([max(len(r), 1) for r in rows])  # [B]
        seqs = torch.zeros(len(rows), int(lengths.max()) if rows else 1, dtype=torch.long)  # [B, L]
        for b, r in enumerate(rows):
            seqs[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.item_logits(self.model.last_hidden(seqs, lengths))  # [B, n]
        finally:
            self.model.train(was_training)
        empty = torch.tensor([not r for r in rows])
        if bool(empty.any()):
            out[empty] = self.item_counts
        return out

    @torch.inference_mode()
    def rank(self, users: Sequence[EvalUser], k: int, exclude_history: bool = False) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        users = list(users)
        kk = min(k, len(self.item_ids))
        for lo in range(0, len(users), SCORE_BATCH):
            chunk = users[lo : lo + SCORE_BATCH]
            s = self.scores([u.history for u in chunk])  # [B, n]
            if exclude_history:
                for b, u in enumerate(chunk):
                    cols = [self._row[int(i)] - 1 for i in u.history if int(i) in self._row]
                    s[b, cols] = float("-inf")
            val, col = torch.topk(s, kk, dim=1)  # [B, kk]
            for b, u in enumerate(chunk):
                ok = val[b] > float("-inf")
                out[u.user_id] = self.item_ids[col[b][ok]].tolist()
        return out

    # ---- persistence ------------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v.detach().contiguous() for k, v in self.model.state_dict().items()}
        tensors.update(item_ids=self.item_ids.contiguous(), item_counts=self.item_counts.contiguous())
        tmp = d / (MODEL_FILE + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(d / MODEL_FILE)
        meta = {"version": CACHE_VERSION, "settings": asdict(self.settings), "fit_on": self.fit_on,
                "info": self.info}
        (d / FIT_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> SASRecBaseline:
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / MODEL_FILE).is_file() or not (d / FIT_FILE).is_file():
            raise UserError(f"no fitted SASRec in {d} (expected {MODEL_FILE} and {FIT_FILE})")
        meta = json.loads((d / FIT_FILE).read_text())
        settings = SASRecSettings(**meta["settings"])
        t = load_file(str(d / MODEL_FILE))
        model = new_model(len(t["item_ids"]), settings)
        model.load_state_dict({k[len("model."):]: v for k, v in t.items() if k.startswith("model.")})
        return cls(model, t["item_ids"], t["item_counts"], settings, meta["fit_on"], meta.get("info"))


def new_model(n_items: int, settings: SASRecSettings) -> SASRec:
    return SASRec(n_items, settings.hidden, settings.blocks, settings.heads, settings.dropout, settings.max_len)


def data_fingerprint(data: SplitData) -> str:
    """sha256 over the catalog ids and every user's train and valid items (what any SASRec fit may see)."""
    h = hashlib.sha256()
    h.update(",".join(map(str, sorted(data.items))).encode())
    for u in sorted(data.train):
        h.update(f"|{u}:{','.join(map(str, data.train[u]))}/{','.join(map(str, data.valid.get(u, [])))}".encode())
    return h.hexdigest()


REFIT_FIELDS = ("refit", "refit_epochs", "refit_lr_scale")  # no bearing on a train-only fit


def cache_dir_for(cache_root: str | Path, data: SplitData, fit_on: str, settings: SASRecSettings) -> Path:
    fields = {k: v for k, v in asdict(settings).items() if fit_on != "train" or k not in REFIT_FIELDS}
    key = json.dumps({"version": CACHE_VERSION, "settings": fields, "fit_on": fit_on,
                      "data": data_fingerprint(data)}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_root) / f"sasrec-{fit_on.replace('+', '_')}-{digest}"


def _fit(data: SplitData, fit_on: str, settings: SASRecSettings, epochs: int, select: bool, progress: bool,
         init: SASRecBaseline | None = None, lr: float | None = None) -> tuple[SASRecBaseline, TrainLog]:
    """One seeded training run on the ``fit_on`` sequences (with valid early stopping when ``select``),
    from fresh weights or from ``init``'s."""
    item_ids = torch.tensor(sorted(data.items), dtype=torch.long)  # [n]
    row = {int(i): r + 1 for r, i in enumerate(item_ids.tolist())}
    seqs = fit_sequences(data, fit_on)
    rows = [[row[i] for i in seqs[u] if i in row] for u in sorted(seqs)]
    counts = torch.zeros(len(item_ids))
    for r in rows:
        for x in r:
            counts[x - 1] += 1
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's generator
        torch.manual_seed(settings.seed)
        model = new_model(len(item_ids), settings)
        if init is not None:
            if not torch.equal(init.item_ids, item_ids):
                raise ValueError("the initial SASRec was fitted on another catalog")
            model.load_state_dict(init.model.state_dict())
        baseline = SASRecBaseline(model, item_ids, counts, settings, fit_on)
        evaluate = None
        if select:
            from recsvc.data.metrics import evaluate_rankings

            users = data.eval_users("valid")
            if settings.eval_users is not None and len(users) > settings.eval_users:
                users = sorted(random.Random(settings.seed).sample(users, settings.eval_users),
                               key=lambda u: u.user_id)

            def evaluate() -> float:
                return evaluate_rankings(baseline.rank(users, 10), users, (10,))["ndcg@10"]

        gen = torch.Generator().manual_seed(settings.seed)
        log = train_sasrec(model, rows, settings, epochs, evaluate, gen, desc=f"sasrec ({fit_on})",
                           progress=progress, lr=lr)
    model.eval()
    return baseline, log


def fit_sasrec(data: SplitData, fit_on: str = "train", settings: SASRecSettings | None = None,
               cache_dir: str | Path | None = None, progress: bool = True) -> SASRecBaseline:
    """A fitted SASRec for ``fit_on`` (loaded from ``cache_dir`` when a fit with the same key is there).

    ``info["fit_seconds"]``: training seconds of the fit (for train+valid: selection + refit), also when the
    model (``info["cached"]``) or its selection fit (``info["selection_cached"]``) comes from the cache.
    """
    settings = (settings or SASRecSettings()).check()
    check_fit_on(fit_on)
    where = cache_dir_for(cache_dir, data, fit_on, settings) if cache_dir is not None else None
    if where is not None and (where / MODEL_FILE).is_file():
        cached = SASRecBaseline.load(where)
        cached.info["cached"] = True
        return cached
    if fit_on == "train":
        baseline, log = _fit(data, "train", settings, settings.max_epochs, True, progress)
        baseline.info = {**_log_info(log), "fit_seconds": log.seconds}
    else:
        selected = fit_sasrec(data, "train", settings, cache_dir, progress)
        if settings.refit == "continue":
            lr = settings.lr * settings.refit_lr_scale
            baseline, log = _fit(data, "train+valid", settings, settings.refit_epochs, False, progress,
                                 init=selected, lr=lr)
        else:
            lr = settings.lr
            baseline, log = _fit(data, "train+valid", settings, max(1, int(selected.info["best_epoch"])), False,
                                 progress)
        sel_s = float(selected.info.get("fit_seconds", 0.0))
        baseline.info = {
            "refit": settings.refit, "epochs": log.epochs, "lr": lr, "stopped": log.stopped,
            "history": log.history, "refit_seconds": log.seconds, "fit_seconds": round(sel_s + log.seconds, 1),
            "selection": {k: v for k, v in selected.info.items() if k not in ("history", "cached")},
            "selection_cached": bool(selected.info.get("cached")),
        }
    baseline.info["cached"] = False
    if where is not None:
        baseline.save(where)
    return baseline


def _log_info(log: TrainLog) -> dict[str, Any]:
    return {"epochs": log.epochs, "best_epoch": log.best_epoch,
            "valid_ndcg@10": None if log.best_ndcg is None else round(log.best_ndcg, 5),
            "stopped": log.stopped, "history": log.history}
