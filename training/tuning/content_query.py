"""Fit the learned content query (``recsvc.content.query.ContentQuery``) on one period's interactions.

Every position t >= 1 of every user's sequence is a training pair: the texts (sentence embeddings) of the up to
``length`` items before t -> the item at t. The query (position weights, then a linear map) and the candidates
(a linear map) are both unit-normalised; their scaled cosine is a logit over the items of the period (a full
softmax: a few thousand to tens of thousands of items fit in one matmul), and cross-entropy is minimised with
Adam. Item identities never enter, so the fitted maps score an item by its text alone: items without any
interaction (the fresh ones) are ranked like the rest. Both maps start at the identity, so an unfitted query is
a position-weighted mean of the history.

A fit is reproducible from its seed; ``fit_or_reuse`` skips it when a file with the same fit record exists (a
rerun of ``recsvc tune fresh`` resumes past it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recsvc.content.fresh import ItemVectors
from recsvc.content.query import ContentQuery
from recsvc.errors import UserError


@dataclass(frozen=True)
class QueryFit:
    length: int = 20  # history items per query
    epochs: int = 1
    lr: float = 1e-3
    batch: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.length < 1 or self.epochs < 1 or self.lr <= 0 or self.batch < 1:
            raise UserError(f"content-query fit settings out of range: {self}")


def training_pairs(sequences: Iterable[list[int]], rows: dict[int, int], length: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(history rows [P, length] left-padded with 0, mask [P, length] 1.0 where an item is, target rows [P])."""
    hist: list[list[int]] = []
    mask: list[list[float]] = []
    target: list[int] = []
    for seq in sequences:
        r = [rows[i] for i in seq if i in rows]
        for t in range(1, len(r)):
            h = r[max(0, t - length):t]
            pad = length - len(h)
            hist.append([0] * pad + h)
            mask.append([0.0] * pad + [1.0] * len(h))
            target.append(r[t])
    return (np.asarray(hist, dtype=np.int64).reshape(-1, length), np.asarray(mask, dtype=np.float32).reshape(
        -1, length), np.asarray(target, dtype=np.int64))


def fit_content_query(sequences: dict[int, list[int]], vectors: ItemVectors, settings: QueryFit,
                      period: str, progress: bool = True) -> ContentQuery:
    """The query fitted on ``sequences`` (user -> chronological items of ``period``); the softmax runs over the
    items those sequences hold."""
    import torch
    import torch.nn.functional as F

    from recsvc_base.progress import progress_bar

    ids = vectors.item_ids.tolist()
    row_of = {int(i): r for r, i in enumerate(ids)}
    period_items = sorted({i for s in sequences.values() for i in s if i in row_of})
    if len(period_items) < 2:
        raise UserError(f"content query: the {period} period holds {len(period_items)} embedded items")
    hist, mask, target = training_pairs(sequences.values(), row_of, settings.length)
    if not len(target):
        raise UserError(f"content query: no (history, next item) pairs in the {period} period")
    cand = torch.tensor([row_of[i] for i in period_items])  # [c] rows of the softmax's items
    col = torch.full((len(ids),), -1, dtype=torch.long)
    col[cand] = torch.arange(len(cand))
    gen = torch.Generator().manual_seed(settings.seed)
    emb = torch.from_numpy(vectors.vectors)  # [n, d]
    d = emb.shape[1]
    pos = torch.zeros(settings.length, requires_grad=True)
    wq = torch.eye(d).requires_grad_()
    wi = torch.eye(d).requires_grad_()
    scale = torch.tensor(math.log(20.0), requires_grad=True)  # logit scale, learnt (log-space)
    opt = torch.optim.Adam([pos, wq, wi, scale], lr=settings.lr)
    H, M, Y = torch.from_numpy(hist), torch.from_numpy(mask), col[torch.from_numpy(target)]
    start, losses = time.monotonic(), []
    steps = settings.epochs * math.ceil(len(Y) / settings.batch)
    bar = progress_bar(total=steps, desc=f"content query ({period})", enabled=progress, leave=False)
    for _ in range(settings.epochs):
        perm = torch.randperm(len(Y), generator=gen)
        for b in range(0, len(Y), settings.batch):
            idx = perm[b:b + settings.batch]
            a = pos.expand(len(idx), -1).masked_fill(M[idx] == 0, -1e9).softmax(dim=1)  # [b, L]
            q = F.normalize((emb[H[idx]] * a[..., None]).sum(dim=1) @ wq.T, dim=1)  # [b, d]
            c = F.normalize(emb[cand] @ wi.T, dim=1)  # [c, d]
            loss = F.cross_entropy(scale.exp() * q @ c.T, Y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
    bar.close()
    fit = {"period": period, "pairs": int(len(Y)), "items": len(period_items), "length": settings.length,
           "epochs": settings.epochs, "lr": settings.lr, "batch": settings.batch, "seed": settings.seed,
           "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
           "seconds": round(time.monotonic() - start, 1)}
    return ContentQuery(pos.detach().numpy().copy(), wq.detach().numpy().copy(), wi.detach().numpy().copy(), fit)


def fit_or_reuse(path: Path, sequences: dict[int, list[int]], vectors: ItemVectors, settings: QueryFit,
                 period: str, progress: bool = True) -> ContentQuery:
    """The query stored at ``path`` when it was fitted with these settings on this period's pairs, else a new
    fit written there."""
    if path.is_file():
        try:
            old = ContentQuery.load(path)
        except UserError:
            old = None
        known = set(vectors.item_ids.tolist())  # training_pairs skips items without a vector: count as it does
        pairs = sum(max(0, sum(i in known for i in s) - 1) for s in sequences.values())
        same = {"period": period, "length": settings.length, "epochs": settings.epochs, "lr": settings.lr,
                "batch": settings.batch, "seed": settings.seed, "pairs": pairs}
        if old is not None and old.dim == vectors.vectors.shape[1] and all(old.fit.get(k) == v
                                                                          for k, v in same.items()):
            return old
    query = fit_content_query(sequences, vectors, settings, period, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    query.save(path)
    return query
