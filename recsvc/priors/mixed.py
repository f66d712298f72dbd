"""A sequence model's item distribution mixed into the fused prior: transition counts + SASRec, one prior.

The transition prior (``recsvc.priors.transition``) knows exact item pairs; a SASRec ("Self-Attentive Sequential
Recommendation") reads the whole recent history and generalises across items. ``MixedPrior`` mixes the two item
distributions and is fused into beam search through the trie exactly like the transition prior alone
(``recsvc.engine.scoring.prior``: a finished item's fused score is its target log-prob + w * log P(item | history)):

    M(j | h) = (1 - mix) * P_transition(j | h) + mix * softmax_j(s(j | h) / temperature)
    P(j | h) ∝ M(j | h) * softmax_j(s(j | h)) ** product

with s(j | h) SASRec's score of item j. The mixture (a sum) lets SASRec add items the counts miss; the product
term (a geometric weight, a product of experts) lets it also take mass from items the counts like and SASRec
does not. ``mix`` = ``product`` = 0 is the transition prior alone. Items SASRec was not fitted on (fresh items)
get only the transition part of the mixture (its popularity back-off) and, in the product term, the lowest
probability SASRec gives any item for that history (no evidence for them). A history of items SASRec does not
know keeps the transition prior. The settings are chosen on validation (``recsvc tune mix``).

Worked example (product = 1, mix = 0): P_transition = [0.5, 0.3, 0.2], softmax(s) = [0.2, 0.6, 0.2]
-> products [0.10, 0.18, 0.04] -> P = [0.31, 0.56, 0.13]: the second item overtakes the first.

Stored beside the transition prior: ``PRIOR_DIR/sequence/`` holds ``model.safetensors`` (SASRec weights under
``model.*``, ``item_ids`` [m], ``item_counts`` [m]; the baselines' format), ``fit.json`` (its settings) and
``mix.json`` (mix, temperature). ``load_prior(dir)`` returns a ``MixedPrior`` when that folder exists, else the
``TransitionPrior``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsvc.errors import UserError
from recsvc.priors.sasrec import SASRec
from recsvc.priors.transition import PriorSettings, TransitionPrior

SEQUENCE_DIR = "sequence"
MODEL_FILE = "model.safetensors"
FIT_FILE = "fit.json"
MIX_FILE = "mix.json"
ARCH_KEYS = ("hidden", "blocks", "heads", "dropout", "max_len")
MAX_PRODUCT = 4.0  # the product term's exponent: at 1 SASRec weighs as much as the mixture


@dataclass(frozen=True)
class MixSettings:
    mix: float = 0.0  # share of the sequence model in the item distribution (0: transition prior alone)
    temperature: float = 1.0  # of the sequence model's softmax in the mixture
    product: float = 0.0  # exponent of the sequence model's softmax (temperature 1) multiplied in (0: none)
    # the prior ranks on its own instead of being fused into the target's search (``recsvc tune mix`` chose it on
    # validation over every fused trial; recsvc.recommender.prior_ranked)
    alone: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix <= 1.0 or self.temperature <= 0 or not 0.0 <= self.product <= MAX_PRODUCT:
            raise UserError(f"mix settings out of range: {self}")


class SequenceModel:
    """A fitted SASRec as a distribution over catalog items (inference only; its rows are ``item_ids``)."""

    def __init__(self, model: SASRec, item_ids: np.ndarray, max_len: int) -> None:
        self.model = model.eval()
        self.item_ids = np.asarray(item_ids, dtype=np.int64)  # [m] item id of row r + 1, ascending
        self.max_len = max_len
        self._row = {int(i): r + 1 for r, i in enumerate(self.item_ids.tolist())}

    @classmethod
    def load(cls, directory: Path) -> SequenceModel:
        from safetensors.torch import load_file

        try:
            settings: dict[str, Any] = json.loads((directory / FIT_FILE).read_text())["settings"]
            t = load_file(str(directory / MODEL_FILE))
            arch = {k: settings[k] for k in ARCH_KEYS}
            model = SASRec(len(t["item_ids"]), **arch)
            model.load_state_dict({k[len("model."):]: v for k, v in t.items() if k.startswith("model.")})
        except (OSError, KeyError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
            raise UserError(f"{directory}: not a fitted sequence model ({exc})") from exc
        return cls(model, t["item_ids"].numpy(), int(arch["max_len"]))

    @torch.inference_mode()
    def scores(self, histories: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (SASRec's scores of the model's items [B, m] float32, whether each history had a known item [B]
        bool; a history without one gets a row of zeros)."""
        if not histories:
            return torch.zeros(0, len(self.item_ids)), torch.zeros(0, dtype=torch.bool)
        row = self._row
        rows = [[row[i] for i in map(int, h) if i in row][-self.max_len:] for h in histories]
        width = max(max(len(r) for r in rows), 1)
        seqs = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)  # [B, L]
        lengths = torch.tensor([max(len(r), 1) for r in rows])  # [B]
        scores = self.model.item_logits(self.model.last_hidden(seqs, lengths)).float()  # [B, m]
        known = torch.tensor([bool(r) for r in rows], dtype=torch.bool)
        if not bool(known.all()):
            scores[~known] = 0.0
        return scores, known

    def log_probs(self, histories: Sequence[Sequence[int]], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (log softmax of score / temperature over the model's items [B, m], whether each history had a
        known item [B] bool; a history without one gets a uniform row)."""
        scores, known = self.scores(histories)
        return torch.log_softmax(scores / temperature, dim=-1), known


class MixedPrior:
    """The transition prior mixed with a sequence model; the engine uses it wherever it takes a prior
    (``item_ids``, ``settings.weight``, ``fitted_on``, ``probs``)."""

    def __init__(self, transition: TransitionPrior, sequence: SequenceModel, mix: MixSettings) -> None:
        self.transition = transition
        self.sequence = sequence
        self.mix = mix
        cols = np.searchsorted(transition.item_ids, sequence.item_ids)  # [m] catalog row of each model row
        cols = np.minimum(cols, len(transition.item_ids) - 1)
        ok = transition.item_ids[cols] == sequence.item_ids
        self._model_rows = torch.from_numpy(np.nonzero(ok)[0])  # model rows that are catalog items
        self._catalog_cols = cols[ok]  # their catalog columns
        self._catalog_cols_t = torch.from_numpy(self._catalog_cols)
        # the model's rows are the catalog's, in its order: no gather / scatter between the two
        self._same_rows = len(sequence.item_ids) == len(transition.item_ids) and bool(ok.all())

    @property
    def item_ids(self) -> np.ndarray:
        return self.transition.item_ids

    @property
    def settings(self) -> PriorSettings:
        return self.transition.settings

    @property
    def fitted_on(self) -> str:
        return self.transition.fitted_on

    def with_items(self, item_ids) -> MixedPrior:
        """This prior over the catalog plus ``item_ids`` (a live catalog's additions): the transition part extended
        (``TransitionPrior.with_items``: zero counts, the popularity back-off), the sequence model unchanged, so a
        new item gets only the transition part, like every item SASRec was not fitted on."""
        grown = self.transition.with_items(item_ids)
        return self if grown is self.transition else MixedPrior(grown, self.sequence, self.mix)

    def with_settings(self, settings: PriorSettings, mix: MixSettings | None = None) -> MixedPrior:
        return MixedPrior(self.transition.with_settings(settings), self.sequence, mix or self.mix)

    def probs(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """[B] histories -> [B, n] P(item | history) over the catalog rows (float32, rows sum to 1).

        One pass of float32 torch ops over [B, n] (the prior runs once per request, before the search)."""
        p = self.transition.probs(histories)  # [B, n]
        if self.mix.mix <= 0 and self.mix.product <= 0:
            return p
        with torch.inference_mode():
            return self._mixed(torch.from_numpy(p), *self.sequence.scores(histories)).numpy()

    def combine(self, p: torch.Tensor, scores: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """``probs`` from its parts computed elsewhere: the transition prior's [B, n] probabilities and
        ``SequenceModel.scores``' (scores [B, m], known [B]) of the same histories (a validation search scores
        SASRec once and mixes it under many settings)."""
        if self.mix.mix <= 0 and self.mix.product <= 0:
            return p
        return self._mixed(p, scores, known)

    def _mixed(self, p: torch.Tensor, scores: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """p [B, n] transition probabilities, scores [B, m] SASRec's, known [B] -> [B, n] the prior (float32)."""
        on_catalog = scores if self._same_rows else scores[:, self._model_rows]  # [B, m'] the catalog's items
        if self.mix.mix > 0:  # softmax over the catalog's model items = the model's softmax renormalised there
            q = self._on_catalog(torch.softmax(on_catalog / self.mix.temperature, dim=-1), p, 0.0)  # [B, n]
            mix = torch.where(known, self.mix.mix, 0.0)[:, None]  # [B, 1]
            p = (1.0 - mix) * p + mix * q
        if self.mix.product > 0:
            logq = torch.log_softmax(on_catalog, dim=-1)  # [B, m']
            full = self._on_catalog(logq, p, logq.amin(dim=1, keepdim=True))  # [B, n] others: the row's minimum
            log_p = p.log() + self.mix.product * torch.where(known[:, None], full, 0.0)  # zero mass stays zero
            top = log_p.amax(dim=1, keepdim=True)
            out = (log_p - torch.where(torch.isfinite(top), top, 0.0)).exp_()
            total = out.sum(dim=1, keepdim=True)
            p = torch.where(total > 0, out / torch.where(total > 0, total, 1.0), p)  # no mass: as it was
        return p

    def _on_catalog(self, values: torch.Tensor, like: torch.Tensor, fill) -> torch.Tensor:
        """values [B, m'] over ``_catalog_cols`` -> [B, n] (other columns: ``fill``, a scalar or [B, 1])."""
        if self._same_rows:
            return values
        out = torch.as_tensor(fill, dtype=like.dtype).expand_as(like).clone()
        return out.index_copy_(1, self._catalog_cols_t, values)

    def save(self, directory: Path, sequence_dir: Path) -> None:
        """The transition prior into ``directory``, the sequence model's files copied from ``sequence_dir``."""
        import shutil

        self.transition.save(directory)
        out = directory / SEQUENCE_DIR
        out.mkdir(parents=True, exist_ok=True)
        for name in (MODEL_FILE, FIT_FILE):
            shutil.copyfile(sequence_dir / name, out / name)
        (out / MIX_FILE).write_text(json.dumps(asdict(self.mix)))


def load_prior(directory: Path) -> TransitionPrior | MixedPrior:
    """BUNDLE/prior (or prior-excl): the transition prior, mixed with its sequence model when one is stored."""
    transition = TransitionPrior.load(directory)
    seq_dir = Path(directory) / SEQUENCE_DIR
    if not (seq_dir / MIX_FILE).is_file():
        return transition
    try:
        mix = MixSettings(**json.loads((seq_dir / MIX_FILE).read_text()))
    except (OSError, TypeError, json.JSONDecodeError) as exc:
        raise UserError(f"{seq_dir / MIX_FILE}: not mix settings ({exc})") from exc
    return MixedPrior(transition, SequenceModel.load(seq_dir), mix)
