"""Item-transition prior: P(next item | the user's last few items) from counted transitions.

The strongest cheap next-item predictor on Amazon data is counting: how often was item j bought right after
item i? ``TransitionPrior`` holds those counts (a sparse [n, n] matrix over the catalog's item rows) and a
popularity back-off, and turns a history into a probability for every catalog item:

    P(j | h) = sum_{t < window} decay^t * P_1(j | h[-1-t]) / sum_{t < window} decay^t
    P_1(j | i) = (count(i -> j) + beta * pop(j)) / (count(i -> *) + beta)
    pop(j)     = (count(j) + 1) / (N + n)        (add-one: every item keeps a non-zero probability)

``window = 1`` is the classic last-item transition model. An empty history (or one of unknown items) gives
``pop``. The same object serves as an evaluation baseline (training/baselines) and as the prior the engine
fuses into beam search (``recsvc.engine.scoring.prior``); it lives in recsvc/ because the service uses it.

Worked example (catalog rows 0, 1, 2; sequences [0, 1], [0, 1], [0, 2], beta = 0 and window 1)::

    count(0 -> 1) = 2, count(0 -> 2) = 1   =>   P(. | [0]) = [0, 2/3, 1/3]

Stored as BUNDLE/prior/transition.safetensors (tensors) + prior.json (settings); never pickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from recsvc.errors import UserError

TENSORS_FILE = "transition.safetensors"
SETTINGS_FILE = "prior.json"


# the largest fusion weight a prior may carry (``recsvc tune mix`` searches up to 30 by default: a weak target's
# fused search may want the prior to dominate)
MAX_WEIGHT = 1000.0


@dataclass(frozen=True)
class PriorSettings:
    window: int = 1  # last items of the history that vote
    decay: float = 0.5  # weight of the t-th last item: decay ** t
    beta: float = 1.0  # popularity back-off pseudo-count per source item
    weight: float = 0.0  # fusion weight of log P in beam search (0 = not fused); see recsvc.engine.scoring.prior

    def check(self) -> PriorSettings:
        if self.window < 1:
            raise UserError(f"prior window must be >= 1, got {self.window}")
        if not 0.0 < self.decay <= 1.0:
            raise UserError(f"prior decay must be in (0, 1], got {self.decay}")
        if self.beta < 0.0:
            raise UserError(f"prior beta must be >= 0, got {self.beta}")
        if not 0.0 <= self.weight <= MAX_WEIGHT:
            raise UserError(f"prior weight must be in [0, {MAX_WEIGHT:g}], got {self.weight}")
        return self


class TransitionPrior:
    def __init__(self, item_ids: np.ndarray, indptr: np.ndarray, indices: np.ndarray, counts: np.ndarray,
                 item_counts: np.ndarray, settings: PriorSettings | None = None, fitted_on: str = "") -> None:
        self.item_ids = np.asarray(item_ids, dtype=np.int64)  # [n] catalog item id of each row (ascending)
        self.indptr = np.asarray(indptr, dtype=np.int64)  # [n + 1] CSR rows: source item
        self.indices = np.asarray(indices, dtype=np.int64)  # [nnz] next item's row
        self.counts = np.asarray(counts, dtype=np.float32)  # [nnz] transition counts
        self.item_counts = np.asarray(item_counts, dtype=np.float32)  # [n] interactions per item
        self.settings = (settings or PriorSettings()).check()
        self.fitted_on = fitted_on
        n = len(self.item_ids)
        # transitions out of each source row (reduceat fails when trailing rows have none: bincount instead)
        src_row = np.repeat(np.arange(n), np.diff(self.indptr))  # [nnz]
        self.out_counts = np.bincount(src_row, weights=self.counts, minlength=n).astype(np.float32)  # [n]
        self.popularity = ((self.item_counts + 1.0) / (self.item_counts.sum() + n)).astype(np.float32)  # [n]
        self._row = {int(i): r for r, i in enumerate(self.item_ids)}

    # ---- fitting --------------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, sequences: Iterable[Sequence[int]], item_ids: Sequence[int], settings: PriorSettings | None = None,
            fitted_on: str = "") -> TransitionPrior:
        """Count consecutive pairs of every chronological sequence; items outside ``item_ids`` are skipped
        (a pair is counted only when both items are in the catalog and adjacent in the sequence)."""
        ids = np.asarray(sorted(int(i) for i in item_ids), dtype=np.int64)
        row = {int(i): r for r, i in enumerate(ids)}
        n = len(ids)
        src, dst = [], []
        item_counts = np.zeros(n, dtype=np.float32)
        for seq in sequences:
            rows = [row.get(int(i), -1) for i in seq]
            for r in rows:
                if r >= 0:
                    item_counts[r] += 1
            for a, b in zip(rows[:-1], rows[1:], strict=False):
                if a >= 0 and b >= 0:
                    src.append(a)
                    dst.append(b)
        if src:
            key = np.asarray(src, dtype=np.int64) * n + np.asarray(dst, dtype=np.int64)
            uniq, cnt = np.unique(key, return_counts=True)  # sorted by (src, dst)
            s, d = uniq // n, uniq % n
        else:
            s = d = np.zeros(0, dtype=np.int64)
            cnt = np.zeros(0)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.add.at(indptr, s + 1, 1)
        indptr = np.cumsum(indptr)
        return cls(ids, indptr, d, cnt.astype(np.float32), item_counts, settings, fitted_on)

    def with_settings(self, settings: PriorSettings) -> TransitionPrior:
        return TransitionPrior(self.item_ids, self.indptr, self.indices, self.counts, self.item_counts, settings,
                               self.fitted_on)

    def with_items(self, item_ids: Iterable[int]) -> TransitionPrior:
        """This prior over the catalog plus ``item_ids`` (items it does not cover get rows with zero counts, so
        they receive only the popularity back-off: add-one mass; items already covered keep their counts).
        Rows stay in ascending item-id order, so new items may land between existing rows."""
        new = np.setdiff1d(np.asarray(list(item_ids), dtype=np.int64), self.item_ids)
        if not len(new):
            return self
        merged = np.union1d(self.item_ids, new)  # [n'] ascending
        old_rows = np.searchsorted(merged, self.item_ids)  # [n] old row -> new row
        n = len(merged)
        src = np.repeat(old_rows, np.diff(self.indptr))  # [nnz] new source row of each stored transition
        dst = old_rows[self.indices]  # [nnz]
        order = np.lexsort((dst, src))  # CSR: by source row, then next item (old order is kept: monotone map)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.add.at(indptr, src + 1, 1)
        item_counts = np.zeros(n, dtype=np.float32)
        item_counts[old_rows] = self.item_counts
        return TransitionPrior(merged, np.cumsum(indptr), dst[order], self.counts[order], item_counts,
                               self.settings, self.fitted_on)

    # ---- scoring --------------------------------------------------------------------------------------------
    def probs(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """[B] histories -> [B, n] P(next = row j | history) (rows in ``item_ids`` order; each row sums to 1)."""
        st = self.settings
        out = np.zeros((len(histories), len(self.item_ids)), dtype=np.float32)
        for b, hist in enumerate(histories):
            rows = [self._row[int(i)] for i in reversed(list(hist)) if int(i) in self._row][: st.window]
            if not rows:
                out[b] = self.popularity
                continue
            total = 0.0
            for t, r in enumerate(rows):
                w = st.decay ** t
                total += w
                denom = self.out_counts[r] + st.beta
                if denom <= 0:  # unseen source item and no back-off: popularity
                    out[b] += w * self.popularity
                    continue
                lo, hi = self.indptr[r], self.indptr[r + 1]
                out[b] += w * st.beta / denom * self.popularity
                np.add.at(out[b], self.indices[lo:hi], w * self.counts[lo:hi] / denom)
            out[b] /= total
        return out

    def rank(self, histories: Sequence[Sequence[int]], k: int, exclude: Sequence[Sequence[int]] | None = None
             ) -> list[list[int]]:
        """Top-k item ids per history (ties: lower item id), optionally without the given items."""
        return top_items(self.probs(histories), self.item_ids, self._row, k, exclude)

    # ---- persistence (safetensors + json) -------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({
            "item_ids": torch.from_numpy(self.item_ids), "indptr": torch.from_numpy(self.indptr),
            "indices": torch.from_numpy(self.indices), "counts": torch.from_numpy(self.counts),
            "item_counts": torch.from_numpy(self.item_counts),
        }, str(d / TENSORS_FILE))
        (d / SETTINGS_FILE).write_text(json.dumps({**asdict(self.settings), "fitted_on": self.fitted_on,
                                                   "transitions": int(self.counts.sum())}, indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> TransitionPrior:
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / TENSORS_FILE).is_file():
            raise UserError(f"no transition prior in {d} (fit one with `recsvc prior fit`)")
        t = load_file(str(d / TENSORS_FILE))
        meta = json.loads((d / SETTINGS_FILE).read_text()) if (d / SETTINGS_FILE).is_file() else {}
        fields = {k: meta[k] for k in ("window", "decay", "beta", "weight") if k in meta}
        return cls(t["item_ids"].numpy(), t["indptr"].numpy(), t["indices"].numpy(), t["counts"].numpy(),
                   t["item_counts"].numpy(), PriorSettings(**fields), str(meta.get("fitted_on", "")))


def top_items(p: np.ndarray, item_ids: np.ndarray, row_of: dict[int, int], k: int,
              exclude: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """[B, n] item probabilities (columns: ``item_ids``; ``row_of``: item id -> column) -> the top-k item ids of
    each row, ties to the lower item id, optionally without the items of ``exclude[b]`` (``p`` is overwritten
    there). Each row sorts only the items at or above its k-th largest value (``np.partition``), which holds every
    item a full sort would list first, ties included."""
    out = []
    n = p.shape[1]
    if exclude is not None:
        for b in range(p.shape[0]):
            p[b, [row_of[int(i)] for i in exclude[b] if int(i) in row_of]] = -1.0
    kth = np.partition(p, n - k, axis=1)[:, n - k] if 0 < k < n else np.full(p.shape[0], -np.inf)  # [B]
    for b in range(p.shape[0]):
        cand = np.flatnonzero(p[b] >= kth[b])
        order = cand[np.lexsort((item_ids[cand], -p[b, cand]))][:k]
        out.append([int(item_ids[r]) for r in order if p[b, r] >= 0])
    return out
