"""Fresh items: catalog items nobody has interacted with yet, ranked by their text and given slots in the list.

A sequence model (the target, SASRec, the transition counts) learns items from interactions, so an item added
to the catalog after the model was fitted (a "fresh" or "cold" item) is never ranked: the transition prior
gives it no mass, and the target never saw its id as a next item. Its text is known, though: every item has a
sentence embedding (the same one its semantic id was made from). ``FreshItems`` ranks the fresh items for a
user by the cosine similarity of their embedding to a query made from the user's last ``window`` history
items: their mean embedding (``query="mean"``), or a query learned from the fitting period's interactions
(``query="learned"``, ``recsvc.content.query``), and ``merge`` gives the best of them at most ``slots``
places at the tail of the top-k, each only when its similarity reaches ``min_similarity``. The settings are
chosen on validation (``recsvc tune fresh``); 0 slots turns the component off.

Worked example (k = 4, slots = 2, min_similarity = 0.5): model list [7, 3, 9, 5]; fresh candidates by
similarity [(40, 0.8), (41, 0.45)] -> 41 is below the threshold -> [7, 3, 9, 40].

Storage (``BUNDLE/fresh``): ``fresh.json`` (settings, the fresh item ids, the period they were counted on) and
``embeddings.safetensors`` (``item_ids`` [n] int64, ``vectors`` [n, d] float16, unit-norm rows) for every
catalog item, so that a history of warm items can be embedded too; ``query-<period>.safetensors`` (the learned
query fitted on that period, when there is one).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsvc.content.query import ContentQuery
from recsvc.errors import UserError

QUERIES = ("mean", "learned")
FRESH_FILE = "fresh.json"
EMBEDDINGS_FILE = "embeddings.safetensors"


@dataclass(frozen=True)
class FreshSettings:
    slots: int = 0  # at most this many fresh items at the tail of a top-k list (0: off)
    window: int = 20  # the user's last `window` history items form the content query
    min_similarity: float = -1.0  # a fresh item takes a slot only with cosine similarity >= this
    query: str = "mean"  # "mean": the window's mean embedding; "learned": a ContentQuery of the fitting period
    # the share of a population of histories whose best fresh candidate may take a slot: when set, min_similarity
    # was resolved from it for this fresh set (``FreshItems.resolve_rate``); None: min_similarity as given
    rate: float | None = None

    def __post_init__(self) -> None:
        if (self.slots < 0 or self.window < 1 or not -1.0 <= self.min_similarity <= 1.0
                or self.query not in QUERIES or (self.rate is not None and not 0.0 < self.rate <= 1.0)):
            raise UserError(f"fresh settings out of range: {self}")


@dataclass(frozen=True)
class ItemVectors:
    """Unit-norm text embeddings of catalog items: item_ids [n] (ascending), vectors [n, d] float32."""

    item_ids: np.ndarray
    vectors: np.ndarray

    def __post_init__(self) -> None:
        if self.item_ids.ndim != 1 or self.vectors.ndim != 2 or len(self.item_ids) != len(self.vectors):
            raise UserError(f"item vectors: ids {self.item_ids.shape} do not match vectors {self.vectors.shape}")
        if len(self.item_ids) > 1 and not np.all(np.diff(self.item_ids) > 0):
            raise UserError("item vectors: item ids must be unique and ascending")

    @classmethod
    def from_arrays(cls, item_ids: Iterable[int], vectors: np.ndarray) -> ItemVectors:
        """Sorts by item id and normalises the rows (a zero row stays zero)."""
        ids = np.asarray(list(item_ids), dtype=np.int64)
        vec = np.asarray(vectors, dtype=np.float32)
        order = np.argsort(ids, kind="stable")
        norm = np.linalg.norm(vec, axis=1, keepdims=True)
        return cls(ids[order], (vec / np.where(norm > 0, norm, 1.0))[order])

    def rows(self, item_ids: Sequence[int]) -> np.ndarray:
        """Row index of each item id, -1 for items without a vector. [m] int64"""
        ids = np.asarray(item_ids, dtype=np.int64)
        pos = np.searchsorted(self.item_ids, ids)
        pos = np.minimum(pos, len(self.item_ids) - 1)
        return np.where(self.item_ids[pos] == ids, pos, -1) if len(self.item_ids) else np.full(len(ids), -1)

    def with_items(self, item_ids: Sequence[int], vectors: np.ndarray) -> ItemVectors:
        """These vectors added (an item already present is replaced)."""
        keep = ~np.isin(self.item_ids, np.asarray(item_ids, dtype=np.int64))
        return ItemVectors.from_arrays(np.concatenate([self.item_ids[keep], np.asarray(item_ids, dtype=np.int64)]),
                                       np.concatenate([self.vectors[keep], np.asarray(vectors, np.float32)]))

    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        save_file({"item_ids": self.item_ids, "vectors": self.vectors.astype(np.float16)}, str(path))

    @classmethod
    def load(cls, path: Path) -> ItemVectors:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            t = load_file(str(path))
            return cls.from_arrays(t["item_ids"], t["vectors"].astype(np.float32))
        except (OSError, KeyError, ValueError, SafetensorError) as exc:
            raise UserError(f"{path}: not an item-embeddings file ({exc})") from exc


class FreshItems:
    """The fresh items of a catalog and the content query that ranks them for a user."""

    def __init__(self, vectors: ItemVectors, fresh: Iterable[int], settings: FreshSettings,
                 counted_on: str = "", query: ContentQuery | None = None) -> None:
        if settings.query == "learned" and query is None:
            raise UserError(f"fresh settings ask for the learned query, and none was fitted on {counted_on!r}")
        if query is not None and query.dim != vectors.vectors.shape[1]:
            raise UserError(f"content query of dimension {query.dim} for item vectors of {vectors.vectors.shape[1]}")
        self.vectors = vectors
        self.settings = settings
        self.counted_on = counted_on
        self.query = query  # the learned query (kept even while settings.query == "mean", for with_settings)
        fresh_ids = np.unique(np.asarray(list(fresh), dtype=np.int64))
        rows = vectors.rows(fresh_ids)
        if (rows < 0).any():
            missing = fresh_ids[rows < 0][:5].tolist()
            raise UserError(f"fresh items without an embedding: {missing}")
        self.fresh_ids = fresh_ids  # [f]
        self._fresh_vectors = vectors.vectors[rows]  # [f, d] unit rows
        if settings.query == "learned":
            assert query is not None
            self._fresh_vectors = query.items(self._fresh_vectors)  # [f, d] unit rows in the query's space

    def __len__(self) -> int:
        return len(self.fresh_ids)

    def with_settings(self, settings: FreshSettings) -> FreshItems:
        return FreshItems(self.vectors, self.fresh_ids, settings, self.counted_on, self.query)

    def with_fresh(self, fresh: Iterable[int], counted_on: str) -> FreshItems:
        """The same vectors, settings and query over another fresh set (e.g. recounted on an earlier period;
        ``load(period=...)`` picks that period's learned query)."""
        return FreshItems(self.vectors, fresh, self.settings, counted_on, self.query)

    def candidates(self, histories: Sequence[Sequence[int]], n: int,
                   excluded: Sequence[Iterable[int]] | None = None) -> list[list[tuple[int, float]]]:
        """Per history, the n fresh items most similar to the query of its last ``window`` items, best first:
        [(item_id, cosine similarity)]. A history without embedded items gets none. Items of the history and
        of ``excluded`` are skipped."""
        out: list[list[tuple[int, float]]] = []
        if n <= 0 or not len(self.fresh_ids):
            return [[] for _ in histories]
        for b, hist in enumerate(histories):
            sims = self.similarities(hist)  # [f]
            if sims is None:
                out.append([])
                continue
            skip = set(hist) | (set(excluded[b]) if excluded is not None else set())
            picked: list[tuple[int, float]] = []
            for r in np.argsort(-sims, kind="stable"):
                item = int(self.fresh_ids[r])
                if item in skip:
                    continue
                picked.append((item, float(sims[r])))
                if len(picked) == n:
                    break
            out.append(picked)
        return out

    def similarities(self, history: Sequence[int]) -> np.ndarray | None:
        """Cosine similarity [f] of every fresh item (``fresh_ids`` order) to the query of the history's last
        ``window`` items; None when none of them has an embedding."""
        rows = self.vectors.rows(list(history)[-self.settings.window:])
        rows = rows[rows >= 0]
        if not len(rows):
            return None
        return self._fresh_vectors @ self._query(self.vectors.vectors[rows])

    def _query(self, history_vectors: np.ndarray) -> np.ndarray:
        """history_vectors [n, d] -> unit query [d] (the settings' kind)."""
        if self.settings.query == "learned":
            assert self.query is not None
            return self.query.query(history_vectors)
        q = history_vectors.mean(axis=0)
        return q / max(float(np.linalg.norm(q)), 1e-12)

    def rate_threshold(self, histories: Sequence[Sequence[int]], rate: float) -> float:
        """The similarity that the best fresh candidate of a ``rate`` share of ``histories`` reaches: the
        (1 - rate) quantile of each history's best similarity (histories without a candidate count as -1).

        A similarity threshold means different things for different fresh sets: a period whose new items read
        like what people buy passes it far more often. A rate is what an operator sets (how many requests may
        show a new item), and resolving it on the fresh set at hand carries it from one period to the next."""
        if not 0.0 < rate <= 1.0:
            raise UserError(f"fresh rate must be in (0, 1], got {rate}")
        best = np.array([c[0][1] if c else -1.0 for c in self.candidates(histories, 1)], dtype=np.float64)
        if not len(best):
            return self.settings.min_similarity
        return float(np.clip(np.quantile(best, 1.0 - rate, method="higher"), -1.0, 1.0)) if rate < 1.0 else -1.0

    def resolve_rate(self, histories: Sequence[Sequence[int]], rate: float) -> FreshItems:
        """These fresh items with ``min_similarity`` set so that a ``rate`` share of ``histories`` passes it
        (``rate_threshold``); the rate is recorded in the settings."""
        from dataclasses import replace

        threshold = self.rate_threshold(histories, rate)
        return self.with_settings(replace(self.settings, min_similarity=threshold, rate=rate))

    def merge(self, ranked: Sequence[int], candidates: Sequence[tuple[int, float]], k: int) -> list[int]:
        """``ranked`` with its tail given to the candidates that pass ``min_similarity`` (at most ``slots``,
        never more than k - 1 so the model keeps its head); duplicates dropped, length min(k, available)."""
        chosen = [i for i, s in candidates if s >= self.settings.min_similarity][: min(self.settings.slots, k - 1)]
        taken = set(chosen)
        head = [i for i in ranked if i not in taken][: k - len(chosen)]
        return head + chosen

    def apply(self, rankings: Sequence[Sequence[int]], histories: Sequence[Sequence[int]], k: int,
              excluded: Sequence[Iterable[int]] | None = None) -> list[list[int]]:
        """``merge`` for a batch (identity when slots == 0)."""
        if self.settings.slots <= 0:
            return [list(r)[:k] for r in rankings]
        cands = self.candidates(histories, self.settings.slots, excluded)
        return [self.merge(r, c, k) for r, c in zip(rankings, cands, strict=True)]

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.vectors.save(out_dir / EMBEDDINGS_FILE)
        (out_dir / FRESH_FILE).write_text(json.dumps({
            "settings": asdict(self.settings), "counted_on": self.counted_on,
            "fresh_items": self.fresh_ids.tolist()}))
        if self.query is not None:
            self.query.save(query_file(out_dir, self.counted_on))

    @classmethod
    def load(cls, out_dir: Path, period: str | None = None) -> FreshItems:
        """The stored component; ``period``: the fitting period whose learned query to use (default: the one the
        fresh set was counted on)."""
        try:
            meta: dict[str, Any] = json.loads((out_dir / FRESH_FILE).read_text())
            settings = FreshSettings(**meta["settings"])
            fresh = [int(i) for i in meta["fresh_items"]]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{out_dir / FRESH_FILE}: not a fresh-items record ({exc})") from exc
        counted_on = str(meta.get("counted_on", ""))
        qfile = query_file(out_dir, period or counted_on)
        query = ContentQuery.load(qfile) if qfile.is_file() else None
        return cls(ItemVectors.load(out_dir / EMBEDDINGS_FILE), fresh, settings, counted_on, query)


def query_file(out_dir: Path, period: str) -> Path:
    """Where the learned query fitted on ``period`` ("train" or "train+valid") is stored."""
    return out_dir / f"query-{period}.safetensors"


def fresh_items_of(catalog: Iterable[int], interacted: Iterable[int]) -> list[int]:
    """Catalog items absent from the interactions of the fitting period.

    >>> fresh_items_of([1, 2, 3, 4], [2, 4, 4])
    [1, 3]
    """
    seen = set(interacted)
    return sorted(int(i) for i in catalog if int(i) not in seen)
