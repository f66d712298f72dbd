"""The served lists as a validation search sees them: the model that has not seen the valid period, with the
bundle's prior refitted on the train period, ranking validation users the way a server of the bundle would.

``recsvc tune fresh`` and ``recsvc tune history`` choose settings on these lists, so the choice is made on what
the service would have shown before the valid period.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recsvc.bundle.directory import Bundle
from recsvc.data.split import EvalUser, SplitData
from tokenizer_rqvae.ids import SemanticIds


def train_period_prior(bundle: Bundle, data: SplitData, ids: SemanticIds, exclude_history: bool) -> Any:
    """The prior a server of the bundle fuses (BUNDLE/prior, or BUNDLE/prior-excl when excluding history), its
    tuned settings fitted on the train period only (with the train-period SASRec when it mixes one in); None
    when the bundle fuses none."""
    from recsvc.priors.mixed import MixedPrior, SequenceModel, load_prior
    from recsvc.priors.transition import TransitionPrior

    if not bundle.has_prior(exclude_history):
        return None
    directory = bundle.prior_dir_for(exclude_history)
    stored = load_prior(directory)
    if stored.settings.weight <= 0:
        return None
    prior: Any = TransitionPrior.fit(data.train.values(), ids.item_ids.tolist(), stored.settings, fitted_on="train")
    if isinstance(stored, MixedPrior) and (directory / "sequence-train").is_dir():
        prior = MixedPrior(prior, SequenceModel.load(directory / "sequence-train"), stored.mix)
    return prior


class ValidationLists:
    """Top-``k`` validation lists of a bundle, with or without each user's history items (the train-only model
    is loaded once, on the first search that needs it)."""

    def __init__(self, bundle: Bundle, data: SplitData, ids: SemanticIds, dtype: str = "auto",
                 what: str = "these settings") -> None:
        from training.tuning.studies import validation_model

        self.bundle, self.data, self.ids, self.dtype = bundle, data, ids, dtype
        self.protocol, self.model_dir = validation_model(bundle, what)  # ``what``: named in its error
        self._model: Any = None  # (serving model, prompt builder, catalog trie, dense head) once a search needs them

    def priors(self, exclude_history: bool) -> Any:
        return train_period_prior(self.bundle, self.data, self.ids, exclude_history)

    def rank(self, users: Sequence[EvalUser], exclude_history: bool, k: int = 10,
             prior: Any = None) -> dict[int, list[int]]:
        """user id -> the served top-``k`` (the prior's own ranking when the bundle serves that, else the fused
        beam search at the served width). ``prior``: the train-period prior (``priors``) when computed already."""
        from recsvc.recommender.prior_ranked import ranks_alone
        from tokenizer_rqvae.trie import CatalogTrie
        from training.baselines.prior_alone import prior_rankings
        from training.evaluation.rankers import is_timeline, ranker_of
        from training.evaluation.ranking import rank_users, serving_model

        if prior is None:
            prior = self.priors(exclude_history)
        if ranks_alone(prior):
            return prior_rankings(prior, users, k, exclude_history)
        if is_timeline(self.model_dir):  # the item-level target: no dense head
            if self._model is None:
                self._model = ranker_of(self.bundle, self.model_dir, self.ids, self.dtype)
            return self._model.lists(users, k, self.bundle.served_beam_width(), exclude_history, prior)
        if self._model is None:  # the model, its prompts and the catalog trie, once
            from recsvc.bundle.loading import load_causal_lm
            from recsvc.content.dense_head import DenseRetriever, has_dense_head
            from training.evaluation.ranking import period_catalog_rows

            dense = None  # the dense head's items ranked with the beams, as served (once `recsvc tune dense` ran)
            if has_dense_head(self.model_dir):
                dense = DenseRetriever.load(self.model_dir, self.ids).within(
                    period_catalog_rows(self.data, "valid", self.ids))
            self._model = (serving_model(load_causal_lm(self.model_dir, dtype=self.dtype)),
                           self.bundle.prompt_builder(ids=self.ids), CatalogTrie(self.ids), dense)
        model, builder, trie, dense = self._model
        return rank_users(model, builder, trie, users, k, 64, exclude_history=exclude_history, prior=prior,
                          beam_width=self.bundle.served_beam_width(), dense=dense)
