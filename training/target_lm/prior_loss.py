"""Prior-aware training: the target learns what the transition prior does not already say (``--prior-loss W``).

Served, the target is fused with an item prior (``recsvc.engine.scoring.prior``): a code c under prefix n scores
``log p_target(c | ...) + w * log Q(c | n)`` with ``Q(c | n) = m(n + c) / m(n)``, the prior's share of that child.
Among the children of one prefix the fused search therefore ranks by ``z_c + w * log Q(c | n)`` (z: the target's
logits). A target trained alone learns the counts too (the next item usually follows the last one the way other
users' sequences did), and the fusion then counts that evidence twice. Trained with the prior inside its softmax,
a product of experts at every code level,

    loss = mean over labelled code tokens of  CE(softmax_v(z_v + W * b_v), label),
    b_v  = log Q(c | prefix) - min over the prefix's children c' of log Q(c' | prefix)
           for v the level's code token c of a child of the label's prefix (some item continues with c),
    b_v  = 0 for every other token of the vocabulary,

the target's logits learn the residual: what moves the next item away from what the counts predict. Softmax is
shift-invariant, so ``b`` is ``log Q`` on the children with every other token set level with the least likely
child: a code no item continues with is neither masked (its logit keeps being pushed down, as plain training does,
so the served search's softmax over the whole vocabulary puts no mass there) nor favoured over any child.

The prior is the last-item transition model of ``recsvc.priors.transition`` (window 1), fitted on the sequences
the target trains on: ``P_1(j | i) = (count(i -> j) + beta * pop(j)) / (count(i -> *) + beta)``. Leave-one-out:
the counted transition being predicted (i -> j at this position) is taken out of the counts, as on validation,
where a user's next transition is never among the counts. Without this the prior would hand the target its own
training labels (most transitions of an Amazon category are counted once).

Worked example (items a = (0, 0), b = (0, 1), c = (1, 0); counts a -> b twice, a -> c once; beta = 0 for clarity):
predicting b after a, leave-one-out counts a -> b once, a -> c once; level 0: Q(0) = 1/2, Q(1) = 1/2; level 1
under prefix (0,): only b has mass, Q(1 | 0) = 1 and code 0 (item a) gets the floor (a has no mass, beta = 0);
the biases b: level 0 [0, 0] on codes 0 and 1, level 1 [0 (not a child), 0 (the only child)].
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from recsvc.bundle.prompt import IGNORE_INDEX, PromptBuilder
from recsvc.errors import UserError
from recsvc.priors.transition import PriorSettings, TransitionPrior

FLOOR = -1e4  # log Q of a code no item continues with (exp() is 0 in float32; finite, so no NaN gradients)


@dataclass(frozen=True)
class PriorLossSettings:
    weight: float = 1.0  # W: the prior's weight inside the training softmax (0: plain LM training)
    beta: float = 1.0  # popularity back-off pseudo-count of the training prior (> 0: every item keeps mass)

    def check(self) -> PriorLossSettings:
        if not 0.0 < self.weight <= 10.0:
            raise UserError(f"--prior-loss must be in (0, 10], got {self.weight}")
        if not self.beta > 0.0:
            raise UserError(f"--prior-loss-beta must be > 0, got {self.beta}")
        return self


class PriorTerm:
    """The per-level log-shares ``log Q(c | prefix)`` of the leave-one-out transition prior, for batches.

    Rows are the semantic ids' item rows (``builder.ids``, ascending item id, as ``TransitionPrior`` orders)."""

    def __init__(self, builder: PromptBuilder, sequences: Iterable[Sequence[int]], beta: float = 1.0) -> None:
        ids = self.ids = builder.ids  # SemanticIds: rows_of maps a window's code spans to item rows
        self.offset = builder.code_offset
        self.size = ids.codebook_size
        self.codes = np.asarray(ids.codes, dtype=np.int64)  # [n, L]
        self.levels = self.codes.shape[1]
        self.beta = beta
        prior = TransitionPrior.fit(sequences, ids.item_ids.tolist(), PriorSettings(window=1, beta=beta))
        self.prior = prior  # the counts, unmodified: what the epoch is chosen with (``PriorFusion.search_prior``)
        self.indptr, self.indices, self.counts = prior.indptr, prior.indices, prior.counts.astype(np.float64)
        pop = prior.popularity.astype(np.float64)  # [n]
        # prefix index of every item at each level: pre[l][row] numbers the distinct prefixes codes[row, :l]
        keys = np.zeros(len(self.codes), dtype=np.int64)
        self.prefix: list[np.ndarray] = []
        self.child_pop: list[np.ndarray] = []  # [prefixes at level l, C]: popularity under each child code
        for level in range(self.levels):
            _, inv = np.unique(keys, return_inverse=True)
            self.prefix.append(inv.astype(np.int64))
            table = np.zeros((int(inv.max()) + 1 if len(inv) else 0, self.size))
            np.add.at(table, (inv, self.codes[:, level]), pop)
            self.child_pop.append(table)
            keys = keys * self.size + self.codes[:, level]

    def log_shares(self, source: np.ndarray, target: np.ndarray) -> np.ndarray:
        """source [K], target [K] item rows (the previous item and the labelled one) -> [K, L, C] float32
        ``log Q(c | target's prefix at level l)`` under the leave-one-out prior P_1(. | source)."""
        k = len(source)
        mass = np.stack([self.beta * self.child_pop[lv][self.prefix[lv][target]] for lv in range(self.levels)],
                        axis=1)  # [K, L, C]
        lo, hi = self.indptr[source], self.indptr[source + 1]
        width = hi - lo
        pos = np.repeat(np.arange(k), width)  # [E] the example of each stored transition
        start = np.repeat(lo - np.cumsum(width) + width, width)
        edge = start + np.arange(int(width.sum()))  # [E] index into indices / counts
        nxt = self.indices[edge]  # [E] next item row
        cnt = self.counts[edge] - (nxt == target[pos])  # leave-one-out: this position's own transition
        for lv in range(self.levels):
            same = self.prefix[lv][nxt] == self.prefix[lv][target[pos]]  # shares the target's prefix up to lv
            np.add.at(mass[:, lv], (pos[same], self.codes[nxt[same], lv]), cnt[same])
        total = mass.sum(axis=2, keepdims=True)
        with np.errstate(divide="ignore"):
            out = np.log(mass / total)
        return np.where(mass > 0, out, FLOOR).astype(np.float32)

    def batch_bias(self, input_ids: torch.Tensor, labels: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, labels [B, T] -> (rows b [N], token positions t [N], levels [N], biases b [N, C]) of every
        labelled code token whose item follows another item in its window (``_window``'s layout: an item's L codes
        are consecutive; the first code of the next item comes after the previous item's codes and separator)."""
        ids = input_ids.cpu().numpy()
        rel = ids - self.offset
        first = (rel >= 0) & (rel < self.size)  # [B, T] level-0 code tokens: item starts
        b, s = np.nonzero(first)
        empty = torch.zeros(0, dtype=torch.long)
        if len(b) == 0:
            return empty, empty, empty, torch.zeros(0, self.size)
        span = (s[:, None] + np.arange(self.levels)[None]).clip(max=ids.shape[1] - 1)  # [I, L]
        codes = rel[b[:, None], span] - self.size * np.arange(self.levels)[None]
        rows = self.ids.rows_of(codes)  # [I]; -1 where the span is not an item's path
        prev = np.r_[-1, rows[:-1]]
        prev[np.r_[True, b[1:] != b[:-1]]] = -1  # an item that opens its row has no previous item
        lab = labels.cpu().numpy()
        use = (rows >= 0) & (prev >= 0) & (lab[b, s] != IGNORE_INDEX)  # labelled items with a previous one
        if not use.any():
            return empty, empty, empty, torch.zeros(0, self.size)
        b, s, rows, prev = b[use], s[use], rows[use], prev[use]
        shares = lifted(self.log_shares(prev, rows))  # [I', L, C]
        lv = np.tile(np.arange(self.levels), len(b))  # [N = I' * L]
        return (torch.from_numpy(np.repeat(b, self.levels)), torch.from_numpy(np.repeat(s, self.levels) + lv),
                torch.from_numpy(lv), torch.from_numpy(shares.reshape(-1, self.size)))


def lifted(shares: np.ndarray) -> np.ndarray:
    """[..., C] log-shares (FLOOR: not a child) -> the loss's biases: ``log Q - min over the children``, 0 elsewhere."""
    child = shares > FLOOR
    low = np.where(child, shares, np.inf).min(axis=-1, keepdims=True)
    return np.where(child, shares - np.where(np.isfinite(low), low, 0.0), 0.0).astype(np.float32)


class PriorFusion:
    """Adds ``weight * b`` (``PriorTerm.batch_bias``) to a batch's logits at its labelled code tokens (module
    docstring).
    Labelled tokens without a previous item (text -> id alignment examples) keep their logits."""

    def __init__(self, term: PriorTerm, weight: float) -> None:
        self.term = term
        self.weight = weight

    def __call__(self, logits: torch.Tensor, keep: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """logits [B, K, V] at positions ``keep`` [K] (column k predicts token keep[k] + 1) -> fused [B, K, V]."""
        b, t, lv, shares = self.term.batch_bias(batch["input_ids"], batch["labels"])
        if not len(b):
            return logits
        column = torch.full((batch["labels"].shape[1],), -1, dtype=torch.long)
        column[keep.cpu() + 1] = torch.arange(len(keep))  # token position -> the logits column predicting it
        col = column[t]
        vocab = self.term.offset + self.term.size * lv[:, None] + torch.arange(self.term.size)[None]  # [N, C]
        dev = logits.device
        return logits.index_put((b[:, None].to(dev), col[:, None].to(dev), vocab.to(dev)),
                                self.weight * shares.to(dev), accumulate=True)


    def search_prior(self) -> TransitionPrior:
        """The training prior as the search fuses it (all counts, window 1, this weight): the prior a
        ``--prior-loss`` target's epoch is chosen with (the tunings choose the served prior's settings later)."""
        return self.term.prior.with_settings(PriorSettings(window=1, beta=self.term.beta, weight=self.weight))


def fusion_for(builder: PromptBuilder, sequences: Iterable[Sequence[int]], settings: PriorLossSettings | None
               ) -> PriorFusion | None:
    """The fusion of ``settings`` over the prior counted on ``sequences`` (the fitting period's); None: off."""
    if settings is None:
        return None
    return PriorFusion(PriorTerm(builder, sequences, settings.beta), settings.weight)
