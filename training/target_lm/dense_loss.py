"""The dense head's training loss beside the language-model loss (``recsvc build --dense-head W``;
``recsvc/content/dense_head.py`` says what the head is and how it is served).

The head is attached to the transformers model as ``model.dense_head`` while it trains (so the loop's optimizer,
checkpoints and budget probe carry it) and taken off before the model is saved (``detach_head``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from recsvc.bundle.prompt import IGNORE_INDEX, PromptBuilder
from recsvc.content.dense_head import DenseHead, DenseSettings
from tokenizer_rqvae.ids import CODEBOOK_SIZE


def attach_head(model, dim: int, seed: int = 0) -> DenseHead:
    """A fresh head on ``model`` (``model.dense_head``), seeded."""
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed + 7919)
        head = DenseHead(model.config.hidden_size, dim)
    model.dense_head = head
    return head


def detach_head(model) -> DenseHead | None:
    """Take the head off ``model`` (unwrapping a peft model's base first); None when it has none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, "dense_head", None)
    if head is not None:
        del base.dense_head
    return head


class DenseLoss:
    """(model, batch) -> (lm loss + weight * dense loss, labelled code tokens): a ``BatchSource`` loss (the LM
    loss with the prior inside when ``fusion`` is given).

    ``items`` [n, D]: every catalog item's text embedding (semantic ids' row order); ``known``: the rows the softmax
    runs over (the fitting period's items: the only ones that can be a target)."""

    def __init__(self, builder: PromptBuilder, items: torch.Tensor, known: Iterable[int],
                 settings: DenseSettings, fusion: Callable | None = None) -> None:
        self.settings = settings
        self.fusion = fusion  # training.target_lm.prior_loss.PriorFusion: the prior inside the LM loss
        self.offset = builder.code_offset
        self.ids = builder.ids
        self.levels = self.ids.levels
        known_rows = torch.as_tensor(sorted(set(known)), dtype=torch.long)  # [m]
        self.row_to_known = torch.full((len(self.ids),), -1, dtype=torch.long)
        self.row_to_known[known_rows] = torch.arange(len(known_rows))
        self.known_items = F.normalize(items.float()[known_rows], dim=-1)  # [m, D]

    def targets(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
        """(rows b [P], positions p [P], softmax targets [P]): position p's hidden state predicts the item whose
        first code is the labelled token p + 1 (only items of the known set)."""
        first = (labels[:, 1:] != IGNORE_INDEX) & (labels[:, 1:] >= self.offset) & (
            labels[:, 1:] < self.offset + CODEBOOK_SIZE)  # [B, T-1]: p + 1 holds a level-0 code
        b, p = first.nonzero(as_tuple=True)
        if len(b) == 0:
            return b, p, b
        span = p[:, None] + 1 + torch.arange(self.levels, device=p.device)[None]  # [P, L]
        span = span.clamp(max=input_ids.shape[1] - 1)
        codes = input_ids[b[:, None], span].cpu() - self.offset - CODEBOOK_SIZE * torch.arange(self.levels)[None]
        rows = torch.from_numpy(self.ids.rows_of(codes.numpy()))  # [P]; -1 where no item has the path
        target = torch.where(rows >= 0, self.row_to_known[rows.clamp(min=0)], torch.full_like(rows, -1))
        ok = (target >= 0).to(b.device)
        return b[ok], p[ok], target[ok.cpu()].to(b.device)

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        labels = batch["labels"][:, 1:]
        keep = (labels != IGNORE_INDEX).any(dim=0).nonzero().squeeze(1)  # [P]
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep,
                    output_hidden_states=True)
        logits = out.logits.float()
        if self.fusion is not None:
            logits = self.fusion(logits, keep, batch)
        target = labels[:, keep]
        n = int((target != IGNORE_INDEX).sum())
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="sum") / max(n, 1)
        if self.settings.weight == 0:
            return lm, n
        dense = self.dense_term(_head_of(model), out.hidden_states[-1], batch["input_ids"], batch["labels"])
        return (lm + self.settings.weight * dense, n) if dense is not None else (lm, n)

    def dense_term(self, head: DenseHead, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor
                   ) -> torch.Tensor | None:
        """The head's mean cross-entropy over the batch's item starts (None when it has none); ``hidden``
        [B, T, H]: the model's final hidden states."""
        b, p, tgt = self.targets(input_ids, labels)
        if len(b) == 0:
            return None
        query = head(hidden[b, p].float())  # [P, D]
        sims = query @ self.known_items.to(query.device).T / self.settings.temperature  # [P, m]
        return F.cross_entropy(sims, tgt)


def _head_of(model: Any) -> DenseHead:
    for m in (model, getattr(model, "module", None)):
        if m is not None and hasattr(m, "dense_head"):
            return m.dense_head
        if m is not None and hasattr(m, "get_base_model") and hasattr(m.get_base_model(), "dense_head"):
            return m.get_base_model().dense_head
    raise AttributeError("the model has no dense_head")
