"""The item-level target's validation figures while it trains (the epoch's choice): its served ranking
(``training.evaluation.rankers.TimelineRanker``: the timeline once per user, the decoder's beam search) scored on
the validation users, the model in eval mode for it and given back to training after."""

from __future__ import annotations

from collections.abc import Sequence

from recsvc.data.metrics import evaluate_rankings
from recsvc.data.split import EvalUser
from recsvc.timeline.model import TimelineModel
from tokenizer_rqvae.trie import CatalogTrie
from training.evaluation.rankers import TimelineRanker


def validation_figures(model: TimelineModel, trie: CatalogTrie, users: Sequence[EvalUser], width: int = 20,
                       exclude_history: bool = True) -> dict[str, float]:
    """Recall / NDCG at 5, 10, 20 of the model alone on ``users``."""
    was_training = model.training
    model.eval()
    try:
        ranked = TimelineRanker(model, trie).lists(users, 20, width, exclude_history)
    finally:
        model.train(was_training)
    return evaluate_rankings(ranked, users, (5, 10, 20))
