"""The target's dense head: its last hidden state predicts the next item's text embedding (after LIGER,
"Unifying Generative and Dense Retrieval for Sequential Recommendation").

Trained beside the language-model loss (``recsvc build --dense-head W``, ``training/target_lm/dense_loss.py``): at each
position where the target predicts an item's first code, a linear map of the hidden state is pulled towards that
item's text embedding and away from the other items of the fitting period's catalog (a full softmax over cosine
similarities, temperature ``temperature``). The text embedding is the one the item's semantic id was made from,
so an item nobody has bought yet has one too: the head can name new items, which the code paths cannot (the
target never saw theirs continue).

Served (``DenseRetriever.merge``): the beams and the head's nearest items are ranked together by one score,

    score(j) = b(j) + blend * cos(q, e_j),   b(j) = the beam's score for a beam item, else the last beam's - floor

(``q``: the head's query for the history, ``e_j``: the item's unit text embedding). ``blend`` = 0 keeps the beams'
order; ``blend``, ``floor``, ``pool`` and ``calibrate`` are chosen on validation (``recsvc tune dense``).

Files in the target directory: ``dense_head.safetensors`` (``proj.weight`` [D, H], ``proj.bias`` [D], the catalog's
unit text embeddings ``items`` [n, D] in the semantic ids' row order) and ``dense_head.json`` (the settings).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from recsvc.errors import UserError

WEIGHTS, SETTINGS = "dense_head.safetensors", "dense_head.json"
CALIBRATIONS = ("none", "pool")


@dataclass(frozen=True)
class DenseSettings:
    weight: float = 1.0  # the dense loss's weight beside the language-model loss (training)
    temperature: float = 0.07  # of the softmax over cosine similarities (training)
    blend: float = 0.0  # the cosine's weight in the served score (0: the beams' order)
    floor: float = 0.0  # how far below the last beam a non-beam item starts
    candidates: int = 20  # the head's nearest items added to the beams per request
    backbone: str = "joint"  # joint: trained with the target (--dense-head); frozen: on a trained target
    pool: str = "all"  # the items the head may add: all, or fresh (those its target never saw: LIGER's cold items)
    calibrate: str = "none"  # none, or pool: fresh items' cosines matched to the known items' (``pool_matched``)
    tuned: dict | None = None  # ``recsvc tune dense``'s record

    def __post_init__(self) -> None:
        if self.weight < 0 or self.temperature <= 0 or self.blend < 0 or self.floor < 0 or self.candidates < 0 or (
                self.pool not in ("all", "fresh")) or self.calibrate not in CALIBRATIONS:
            raise UserError(f"dense head settings out of range: {self}")


class DenseHead(nn.Module):
    """hidden [..., H] -> unit query [..., D]."""

    def __init__(self, hidden: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(hidden.to(self.proj.weight.dtype)), dim=-1)


def has_dense_head(target_dir: str | Path) -> bool:
    return (Path(target_dir) / WEIGHTS).is_file() and (Path(target_dir) / SETTINGS).is_file()


def save_dense_head(target_dir: str | Path, head: DenseHead, items: torch.Tensor, settings: DenseSettings,
                    known: Sequence[int] = (), item_ids: Sequence[int] | None = None) -> None:
    """``items``: [n, D] text embeddings in the semantic ids' row order (unit-normalised here); ``known``: the rows
    of the items the target was trained on (its fitting period's; the others are fresh to it)."""
    from safetensors.torch import save_file

    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"proj.{k}": v.detach().float().cpu().contiguous() for k, v in head.proj.state_dict().items()}
    tensors["items"] = F.normalize(items.float(), dim=-1).cpu().contiguous()
    mask = torch.zeros(len(items), dtype=torch.uint8)
    mask[torch.as_tensor(sorted(known), dtype=torch.long)] = 1
    tensors["known"] = mask
    if item_ids is not None:  # the item of each row: a catalog that grows later is re-laid out by item id
        tensors["item_ids"] = torch.as_tensor(list(item_ids), dtype=torch.long)
    save_file(tensors, str(target_dir / WEIGHTS))
    write_settings(target_dir, settings)


def write_settings(target_dir: str | Path, settings: DenseSettings) -> None:
    (Path(target_dir) / SETTINGS).write_text(json.dumps(asdict(settings), indent=1))


def read_settings(target_dir: str | Path) -> DenseSettings:
    return DenseSettings(**json.loads((Path(target_dir) / SETTINGS).read_text()))


@torch.no_grad()
def last_hidden(model, prompts: Sequence[Sequence[int]], pad_id: int = 0) -> torch.Tensor:
    """[B, H] the target's final hidden state (after its last norm) at each prompt's last token: where the next
    item's first code is predicted. ``model``: a transformers causal LM (its ``.model`` is the backbone)."""
    device = next(model.parameters()).device
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for r, p in enumerate(prompts):  # right padding: each row's positions are those of its prompt alone
        ids[r, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        mask[r, : len(p)] = 1
    out = model.model(input_ids=ids.to(device), attention_mask=mask.to(device))
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    return out.last_hidden_state[torch.arange(len(prompts), device=device), last].float()  # [B, H]


class DenseRetriever:
    """The served side: a head, the catalog's unit text embeddings and the merge settings."""

    def __init__(self, head: DenseHead, items: torch.Tensor, settings: DenseSettings,
                 absent: torch.Tensor | None = None, known: torch.Tensor | None = None) -> None:
        self.head, self.items, self.settings = head.eval(), items.float(), settings  # items [n, D]
        self.absent = absent  # [n] bool: rows the head may not add (not in the catalog of the period served)
        self.known = known  # [n] bool: the rows the target was trained on (pool "fresh" adds only the others)
        self.item_ids: np.ndarray | None = None  # [n] the item of each row, when known (``over`` needs it)

    @classmethod
    def load(cls, target_dir: str | Path, ids=None) -> DenseRetriever:
        """``ids``: the catalog served now (``SemanticIds``): the head's rows are laid out in its order, by item id;
        an item the head has no embedding for (added to a live catalog since) is never added by it."""
        from safetensors.torch import load_file

        tensors = load_file(str(Path(target_dir) / WEIGHTS))
        items = tensors.pop("items")
        known = tensors.pop("known").bool() if "known" in tensors else None
        saved_ids = tensors.pop("item_ids", None)
        weight = tensors["proj.weight"]
        head = DenseHead(weight.shape[1], weight.shape[0])
        head.proj.load_state_dict({"weight": weight, "bias": tensors["proj.bias"]})
        absent = None
        if ids is not None and saved_ids is not None:
            row_of = {int(i): r for r, i in enumerate(saved_ids.tolist())}
            rows = torch.tensor([row_of.get(int(i), -1) for i in ids.item_ids.tolist()], dtype=torch.long)
            absent = rows < 0
            items = torch.where(absent[:, None], torch.zeros(()), items[rows.clamp(min=0)])
            if known is not None:
                known = known[rows.clamp(min=0)] & ~absent
        elif ids is not None and items.shape[0] != len(ids):
            raise UserError(f"the dense head embeds {items.shape[0]} items, the catalog has {len(ids)}: retrain "
                            "the target")
        out = cls(head, items, read_settings(target_dir), known=known)
        out.absent = absent if absent is not None and bool(absent.any()) else None
        out.item_ids = (ids.item_ids.astype(np.int64) if ids is not None
                        else saved_ids.numpy() if saved_ids is not None else None)
        return out

    def over(self, ids, new_items: np.ndarray, new_vectors: np.ndarray) -> DenseRetriever:
        """The head over a grown catalog ``ids`` (``SemanticIds``): ``new_items`` [m] joined with their text
        vectors [m, D] (the embedder the ids use, as ``recsvc catalog add`` computes them). A new item is fresh to
        the target, so pool "fresh" can add it."""
        if self.item_ids is None:
            raise UserError("the dense head has no item ids: retrain the target to serve a growing catalog")
        vec = torch.as_tensor(np.asarray(new_vectors, dtype=np.float32)).reshape(len(new_items), -1)
        embedded = vec.shape[1] == self.items.shape[1]  # else (no text vectors given): the head never adds them
        vec = F.normalize(vec, dim=-1) if embedded else vec
        old = {int(i): r for r, i in enumerate(self.item_ids.tolist())}
        new = {int(i): r for r, i in enumerate(np.asarray(new_items).tolist())}
        n = len(ids.item_ids)
        items = torch.zeros((n, self.items.shape[1]))
        known = torch.zeros(n, dtype=torch.bool)
        absent = torch.zeros(n, dtype=torch.bool)
        for r, item in enumerate(ids.item_ids.tolist()):
            if int(item) in new:
                if embedded:
                    items[r] = vec[new[int(item)]]
                else:
                    absent[r] = True
            elif int(item) in old:
                o = old[int(item)]
                items[r] = self.items[o]
                known[r] = bool(self.known[o]) if self.known is not None else False
                absent[r] = bool(self.absent[o]) if self.absent is not None else False
            else:
                absent[r] = True
        out = DenseRetriever(self.head, items, self.settings, absent if bool(absent.any()) else None,
                             known if self.known is not None else None)
        out.item_ids = ids.item_ids.astype(np.int64)
        return out

    def with_settings(self, **changes) -> DenseRetriever:
        out = DenseRetriever(self.head, self.items, replace(self.settings, **changes), self.absent, self.known)
        out.item_ids = self.item_ids
        return out

    def within(self, rows: Sequence[int]) -> DenseRetriever:
        """The same head adding only these catalog rows (an evaluation of a past period: the items its catalog
        held; a beam item is never removed)."""
        absent = torch.ones(len(self.items), dtype=torch.bool)
        absent[torch.as_tensor(list(rows), dtype=torch.long)] = False
        if self.absent is not None:
            absent |= self.absent
        out = DenseRetriever(self.head, self.items, self.settings, absent, self.known)
        out.item_ids = self.item_ids
        return out

    @property
    def active(self) -> bool:
        return self.settings.blend > 0 and self.settings.candidates > 0

    @torch.no_grad()
    def similarities(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> [B, n] cosine of each history's query to every catalog item."""
        return self.head(hidden.cpu()) @ self.items.T

    def merge(self, items: Sequence[int], scores: Sequence[float], sims: torch.Tensor, rows_of, k: int,
              excluded: Sequence[int] = ()) -> tuple[list[int], list[float]]:
        """The beams (``items`` best first, their ``scores``) and the head's ``candidates`` nearest items (``sims``
        [n] over the catalog's rows; ``rows_of``: item id -> row, and ``rows_of.item_ids`` row -> item id) ranked
        by one score (module docstring); the first ``k``."""
        s = self.settings
        if not items:
            return list(items), list(scores)
        sims = sims.float()
        if s.calibrate == "pool" and self.known is not None:
            sims = pool_matched(sims, self.known, self.absent)
        beam_rows = [rows_of.index_of(i) for i in items]
        merged = {i: float(sc) + s.blend * float(sims[r]) for i, sc, r in zip(items, scores, beam_rows, strict=True)}
        base = float(scores[-1]) - s.floor
        masked = sims.clone()
        if self.absent is not None:
            masked[self.absent] = -torch.inf
        if s.pool == "fresh" and self.known is not None:
            masked[self.known] = -torch.inf
        if beam_rows:
            masked[torch.tensor(beam_rows)] = -torch.inf
        ex = [rows_of.index_of(i) for i in excluded if i in rows_of]
        if ex:
            masked[torch.tensor(ex)] = -torch.inf
        m = min(s.candidates, int(torch.isfinite(masked).sum()))
        if m > 0:
            top = torch.topk(masked, m)
            for v, r in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                merged[int(rows_of.item_ids[r])] = base + s.blend * v
        ranked = sorted(merged.items(), key=lambda kv: -kv[1])[:k]
        return [i for i, _ in ranked], [v for _, v in ranked]


def pool_matched(sims: torch.Tensor, known: torch.Tensor, absent: torch.Tensor | None = None) -> torch.Tensor:
    """sims [n] (one query's cosines) -> the same with the fresh rows' (``~known``) standardised and put on the
    known rows' mean and spread; absent rows count in neither. Why: the head was trained with a softmax over the
    items its target knew, which pulls a query towards them and pushes it from none of the fresh ones, so every
    fresh item's cosine sits lower (on Beauty's validation: 0.07 for the cold target against 0.28 for the best
    beam). Matching the two pools per query ranks a fresh item by how near it is among the fresh ones. Unchanged
    when either pool has fewer than two rows.

        >>> s = pool_matched(torch.tensor([0.5, 0.3, 0.1, 0.0]), torch.tensor([True, True, False, False]))
        >>> [round(x, 2) for x in s.tolist()]
        [0.5, 0.3, 0.5, 0.3]
    """
    live = ~absent if absent is not None else torch.ones_like(known)
    k_rows, f_rows = known & live, ~known & live
    if int(k_rows.sum()) < 2 or int(f_rows.sum()) < 2:
        return sims
    k, f = sims[k_rows], sims[f_rows]
    out = sims.clone()
    out[f_rows] = k.mean() + k.std() * (f - f.mean()) / f.std().clamp(min=1e-6)
    return out


def item_embeddings(item_ids: np.ndarray, vectors: dict[int, np.ndarray], dim: int) -> torch.Tensor:
    """[n, D] the vectors in ``item_ids``' order (zeros for an item without one: it is never near any query)."""
    out = np.zeros((len(item_ids), dim), dtype=np.float32)
    for r, item in enumerate(item_ids.tolist()):
        v = vectors.get(int(item))
        if v is not None:
            out[r] = v
    return torch.from_numpy(out)
