"""SASRec's training loop: full-softmax cross-entropy on every position, early stopping on valid NDCG@10.

For a fitted sequence s_1..s_T (item rows, the last ``max_len + 1`` kept) the inputs are s_1..s_{T-1} and the
targets s_2..s_T; the loss is the mean over all real positions of a batch of

    -log softmax(logits_t)[s_{t+1}]        over all n items (not SASRec's sampled BCE)

Batches: users shuffled (seeded generator), then sorted by length inside chunks of 32 batches so a batch
pads little; the batch order is shuffled again. Every ``eval_every`` epochs a callback gives the valid
NDCG@10; training stops after ``patience`` evaluations without improvement, at ``max_epochs``, or when the
next epoch would overrun the ``budget_s`` wall-clock budget. The best evaluated weights are restored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from recsvc.priors.sasrec import SASRec
from recsvc_base.progress import progress_bar
from training.choices import REFIT_MODES

BUCKET_BATCHES = 32  # batches per length-sorted chunk


@dataclass(frozen=True)
class SASRecSettings:
    """Defaults for Amazon Beauty (12k items, 19k users, ~6 train items per user) on one CPU thread.

    One epoch is ~102k softmax rows over 12k items: ~35 s on one (shared) CPU thread, so the 10-minute budget
    holds ~15 epochs. lr 3e-3 rather than SASRec's 1e-3 for that reason (measured on Beauty, valid NDCG@10
    after 8 epochs: 0.0083 at lr 1e-3 / dropout 0.5, 0.0138 at 3e-3 / 0.3, 0.0152 at 3e-3 / 0.5, the peak of
    that run); a valid evaluation (~1 s) after every epoch.
    """

    hidden: int = 64
    blocks: int = 2
    heads: int = 1
    dropout: float = 0.5
    max_len: int = 50
    lr: float = 3e-3
    batch_size: int = 128
    max_epochs: int = 200
    eval_every: int = 1  # epochs between valid evaluations
    patience: int = 3  # evaluations without improvement before stopping
    max_minutes: float = 10.0  # wall-clock budget of each training run (the selection; the deploy refit)
    eval_users: int | None = 5000  # valid users for early stopping (a fixed sample when there are more)
    seed: int = 0
    # deploy protocol (fit on train + valid): refit from "scratch" for the epoch count selected on valid, or
    # "continue" the selected train-only weights for refit_epochs at lr * refit_lr_scale (what
    # `recsvc train target --protocol deploy` does; one epoch instead of ~8, but weaker on Beauty test:
    # Recall@10 0.0138 vs 0.0222 from scratch)
    refit: str = "scratch"
    refit_epochs: int = 1
    refit_lr_scale: float = 0.5

    def check(self) -> SASRecSettings:
        from recsvc.errors import UserError

        if self.refit not in REFIT_MODES:
            raise UserError(f"SASRec refit must be {' or '.join(REFIT_MODES)}, got {self.refit!r}")
        if min(self.hidden, self.blocks, self.heads, self.max_len, self.batch_size, self.max_epochs,
               self.eval_every, self.patience, self.refit_epochs) < 1:
            raise UserError(f"SASRec sizes, epochs and patience must be >= 1: {self}")
        if not 0.0 <= self.dropout < 1.0 or self.lr <= 0 or self.max_minutes <= 0 or self.refit_lr_scale <= 0:
            raise UserError(f"bad SASRec settings (dropout in [0, 1), lr, max_minutes, refit_lr_scale > 0): {self}")
        return self


@dataclass
class TrainLog:
    epochs: int = 0  # epochs run
    best_epoch: int = 0  # the epoch whose weights were kept
    best_ndcg: float | None = None  # valid NDCG@10 of those weights (None without evaluation)
    stopped: str = "max_epochs"  # "max_epochs" | "early" | "budget"
    seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)  # per epoch: loss, seconds, ndcg@10 if evaluated


def training_examples(sequences: Sequence[Sequence[int]], max_len: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of item rows -> inputs [N, max_len], targets [N, max_len] (right-padded with 0), lengths [N].

    Sequences with fewer than 2 items have no target and are skipped.
    """
    kept = [list(s)[-(max_len + 1):] for s in sequences if len(s) >= 2]
    inputs = torch.zeros(len(kept), max_len, dtype=torch.long)
    targets = torch.zeros(len(kept), max_len, dtype=torch.long)
    lengths = torch.zeros(len(kept), dtype=torch.long)
    for r, s in enumerate(kept):
        n = len(s) - 1
        inputs[r, :n] = torch.tensor(s[:-1])
        targets[r, :n] = torch.tensor(s[1:])
        lengths[r] = n
    return inputs, targets, lengths


def epoch_batches(lengths: torch.Tensor, batch_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """[N] lengths -> index tensors of one epoch's batches (shuffled, length-bucketed)."""
    perm = torch.randperm(len(lengths), generator=gen)
    batches: list[torch.Tensor] = []
    chunk = batch_size * BUCKET_BATCHES
    for lo in range(0, len(perm), chunk):
        idx = perm[lo : lo + chunk]
        idx = idx[torch.argsort(lengths[idx], stable=True)]
        batches.extend(idx.split(batch_size))
    order = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in order]


def train_sasrec(
    model: SASRec, sequences: Sequence[Sequence[int]], settings: SASRecSettings, epochs: int,
    evaluate: Callable[[], float] | None = None, gen: torch.Generator | None = None, desc: str = "sasrec",
    progress: bool = True, lr: float | None = None,
) -> TrainLog:
    """Train ``model`` in place on item-row sequences; with ``evaluate`` (-> valid NDCG@10) keep the best.
    ``lr`` overrides ``settings.lr`` (the deploy continuation)."""
    gen = gen or torch.Generator().manual_seed(settings.seed)
    inputs, targets, lengths = training_examples(sequences, settings.max_len)
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr if lr is None else lr, betas=(0.9, 0.98))
    budget_s = 60.0 * settings.max_minutes
    log = TrainLog()
    best_state: dict[str, torch.Tensor] | None = None
    bad = 0
    start = time.perf_counter()

    def run_eval(epoch: int) -> bool:
        """Evaluate; True when patience is exhausted."""
        nonlocal best_state, bad
        assert evaluate is not None
        score = evaluate()
        log.history[-1]["ndcg@10"] = round(score, 5)
        if log.best_ndcg is None or score > log.best_ndcg:
            log.best_ndcg, log.best_epoch, bad = score, epoch, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return False
        bad += 1
        return bad >= settings.patience

    chunk = settings.batch_size * BUCKET_BATCHES  # as in epoch_batches
    n_batches = len(lengths) // chunk * BUCKET_BATCHES + -(-(len(lengths) % chunk) // settings.batch_size)
    bar = progress_bar(total=epochs * n_batches, desc=desc, unit="batch", enabled=progress, leave=False)
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        model.train()
        total, count = 0.0, 0
        for idx in epoch_batches(lengths, settings.batch_size, gen):
            width = int(lengths[idx].max())
            x, y = inputs[idx, :width], targets[idx, :width]  # [B, W]
            real = y > 0  # [B, W]
            h = model.hidden_states(x)[real]  # [P, d]
            loss = F.cross_entropy(model.item_logits(h), y[real] - 1)  # over all n items
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * int(real.sum())
            count += int(real.sum())
            bar.update(1)
        epoch_s = time.perf_counter() - t0
        log.epochs = epoch
        log.history.append({"epoch": epoch, "loss": round(total / max(count, 1), 4), "seconds": round(epoch_s, 1)})
        evaluated = evaluate is not None and epoch % settings.eval_every == 0
        if evaluated and run_eval(epoch):
            log.stopped = "early"
            break
        shown = {"epoch": epoch, "loss": f"{total / max(count, 1):.3f}"}
        if log.best_ndcg is not None:
            shown["best"] = f"{log.best_ndcg:.4f}@{log.best_epoch}"
        bar.set_postfix(shown)
        if epoch < epochs and time.perf_counter() - start + 1.2 * epoch_s > budget_s:
            if evaluate is not None and not evaluated:
                run_eval(epoch)
            log.stopped = "budget"
            break
    else:
        if evaluate is not None and log.epochs % settings.eval_every != 0:
            run_eval(log.epochs)
    bar.close()
    if best_state is not None:
        model.load_state_dict(best_state)
    elif evaluate is None:
        log.best_epoch = log.epochs
    log.seconds = round(time.perf_counter() - start, 1)
    return log
