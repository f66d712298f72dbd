"""The item-level target's training examples: users' item sequences as windows of catalog rows, batched.

Every position of a window is an example (the next item's codes given the timeline state there). A sequence
longer than ``max_items + 1`` is cut from its end into windows of ``max_items + 1`` items that overlap by one,
so every transition is trained once per epoch. Optional augmentation (``crop``): each epoch, each window is
replaced with probability ``crop`` by a random contiguous part of at least two items (random crops, as in the
SASRec training ladder of "Turning Dross Into Gold Loss: is BERT4Rec really better than SASRec?" and MARIUS).

Shapes: B windows, T positions (<= max_items), L levels.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenizer_rqvae.ids import SemanticIds


def windows(sequences: Mapping[int, Sequence[int]], ids: SemanticIds, max_items: int) -> list[np.ndarray]:
    """user -> items (oldest first) -> windows of catalog rows (items without an id skipped), users in id order."""
    out: list[np.ndarray] = []
    span = max_items + 1
    for user in sorted(sequences):
        rows = np.array([ids.index_of(i) for i in sequences[user] if i in ids], dtype=np.int64)
        end = len(rows)
        while end >= 2:
            out.append(rows[max(0, end - span) : end])
            end -= span - 1
    return out


def crop(window: np.ndarray, rng: random.Random) -> np.ndarray:
    """A random contiguous part of ``window`` of at least two items."""
    n = len(window)
    length = rng.randint(2, n)
    start = rng.randint(0, n - length)
    return window[start : start + length]


@dataclass(frozen=True)
class Batch:
    codes: torch.Tensor  # [B, T, L] input items' codes (-1: padding)
    rows: torch.Tensor  # [B, T] input items' per-item table rows (catalog row + 1; 0: padding)
    targets: torch.Tensor  # [B, T, L] the next item's codes (-1: no example at this position)


def collate(parts: Sequence[np.ndarray], codes: torch.Tensor) -> Batch:
    """Windows of catalog rows -> a right-padded batch; ``codes`` [n, L] the catalog's code table."""
    t = max(len(p) for p in parts) - 1
    rows = torch.full((len(parts), t + 1), -1, dtype=torch.long)
    for b, p in enumerate(parts):
        rows[b, : len(p)] = torch.from_numpy(p)
    table = torch.cat([codes, torch.full((1, codes.shape[1]), -1, dtype=torch.long)])  # row -1: padding codes
    all_codes = table[rows]  # [B, T + 1, L]
    return Batch(all_codes[:, :-1], (rows[:, :-1] + 1), all_codes[:, 1:])


def epoch_batches(parts: Sequence[np.ndarray], batch_size: int, seed: int, crop_rate: float,
                  codes: torch.Tensor) -> list[Batch]:
    """One epoch's batches, shuffled by ``seed`` (windows of similar length together: little padding)."""
    rng = random.Random(seed)
    chosen = [crop(p, rng) if crop_rate > 0 and len(p) > 2 and rng.random() < crop_rate else p for p in parts]
    order = list(range(len(chosen)))
    rng.shuffle(order)
    chunk = batch_size * 32
    batches: list[list[int]] = []
    for s in range(0, len(order), chunk):
        part = sorted(order[s : s + chunk], key=lambda i: len(chosen[i]))
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return [collate([chosen[i] for i in b], codes) for b in batches]
