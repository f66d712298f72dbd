"""The fused prior's numpy implementation, as served before the float32 torch one (``MixedPrior.probs``).

Kept as the reference that the torch path is tested against (same distribution up to float32 rounding), and as
part of the request that ``recsvc bench cache``'s ``lean`` path times (the request as it was served before the
engine's speed work: the lean forward and this prior). Same formula (``recsvc.priors.mixed``):

    M(j | h) = (1 - mix) * P_transition(j | h) + mix * softmax_j(s(j | h) / temperature)
    P(j | h) ∝ M(j | h) * softmax_j(s(j | h)) ** product

built with numpy arrays: the mixture in float32, the product term in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recsvc.priors.mixed import MixedPrior


class ReferenceMixedPrior(MixedPrior):
    """``MixedPrior`` whose ``probs`` is the numpy reference (``with_items`` / ``with_settings`` return the served
    ``MixedPrior``)."""

    @classmethod
    def of(cls, prior: MixedPrior) -> ReferenceMixedPrior:
        return cls(prior.transition, prior.sequence, prior.mix)

    def probs(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """[B] histories -> [B, n] P(item | history) over the catalog rows (float32, rows sum to 1)."""
        p = self.transition.probs(histories)  # [B, n]
        if self.mix.mix <= 0 and self.mix.product <= 0:
            return p
        scores, known = self.sequence.scores(histories)  # [B, m]
        if self.mix.mix > 0:
            logq = torch.log_softmax(scores / self.mix.temperature, dim=-1)  # [B, m]
            q = np.zeros_like(p)
            q[:, self._catalog_cols] = logq[:, self._model_rows].exp().numpy()
            q /= np.maximum(q.sum(axis=1, keepdims=True), 1e-30)
            mix = np.where(known.numpy()[:, None], self.mix.mix, 0.0).astype(np.float32)  # [B, 1]
            p = ((1.0 - mix) * p + mix * q).astype(np.float32)
        if self.mix.product > 0:
            rows = torch.log_softmax(scores[:, self._model_rows], dim=-1)  # [B, m'] over the catalog's items
            p = self._times_product(p, rows.numpy(), known.numpy()).astype(np.float32)
        return p

    def _times_product(self, p: np.ndarray, logq: np.ndarray, known: np.ndarray) -> np.ndarray:
        """p [B, n] * q ** product, renormalised; logq [B, m'] over ``_catalog_cols`` (other items: the row's
        minimum); rows of unknown histories (known [B] False) unchanged."""
        full = np.repeat(logq.min(axis=1, keepdims=True), p.shape[1], axis=1)  # [B, n]
        full[:, self._catalog_cols] = logq
        full[~known] = 0.0
        with np.errstate(divide="ignore"):  # zero mass stays zero
            log_p = np.log(p.astype(np.float64)) + self.mix.product * full
        top = log_p.max(axis=1, keepdims=True)
        out = np.exp(log_p - np.where(np.isfinite(top), top, 0.0))
        total = out.sum(axis=1, keepdims=True)
        return np.where(total > 0, out / np.where(total > 0, total, 1.0), p)  # a row without mass stays as it was
