"""A target as the evaluation and the tunings read it, whatever its architecture: a ``TargetRanker``.

Three reads cover every ranking of ``recsvc eval`` and the validation searches (``tune prior`` / ``tune mix``):
- ``lists``: each user's served top-k (plain trie-constrained beam search at the served width, the prior fused when
  given, history excluded or not);
- ``wide_beam``: an unfused constrained beam search far wider than the served width, each depth's beams with the
  partial sums of their code log-probs (the re-scored trials' candidates, ``training.tuning.rescore_cache``);
- ``leaf_logprobs``: the same partial sums for given leaves (the candidates the prior adds).

``TokenRanker``: the LLaMA token target (a prompt of four code tokens per history item, the engine's searches).
``TimelineRanker``: the item-level target (``recsvc.timeline``: the timeline once per user, the code decoder's
search). ``ranker_of`` picks one from a model directory.

Shapes: B users of a batch, W beams, n leaves per user, L levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from recsvc.bundle.prompt import PromptBuilder
from recsvc.data.split import EvalUser
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.timeline.config import CONFIG_FILE
from recsvc.timeline.model import TimelineModel
from recsvc.timeline.search import beam_search, user_states
from tokenizer_rqvae.trie import CatalogTrie
from training.evaluation import token_passes
from training.evaluation.traced import Beams, partial_sums


class TargetRanker(Protocol):
    trie: CatalogTrie

    @property
    def max_history(self) -> int: ...  # history items a request reads (the last ones)

    @property
    def dtype(self) -> torch.dtype: ...

    def lists(self, users: Sequence[EvalUser], k: int, width: int, exclude_history: bool,
              prior: Any = None) -> dict[int, list[int]]: ...

    def wide_beam(self, histories: Sequence[Sequence[int]], width: int, dead: torch.Tensor | None) -> Beams: ...

    def leaf_logprobs(self, histories: Sequence[Sequence[int]], leaves: torch.Tensor) -> torch.Tensor: ...


class TokenRanker:
    """The token target through the engine (``training.evaluation.ranking.rank_users`` and the rescore cache's
    forced passes)."""

    def __init__(self, model: EngineModel, builder: PromptBuilder, trie: CatalogTrie) -> None:
        self.model, self.builder, self.trie = model, builder, trie

    @property
    def max_history(self) -> int:
        return self.builder.max_history

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def lists(self, users: Sequence[EvalUser], k: int, width: int, exclude_history: bool,
              prior: Any = None) -> dict[int, list[int]]:
        from training.evaluation.ranking import rank_users

        return rank_users(self.model, self.builder, self.trie, users, k, 64, exclude_history=exclude_history,
                          progress=False, prior=prior, beam_width=width)

    def _prompts(self, histories: Sequence[Sequence[int]]) -> PromptBatch:
        return PromptBatch.from_lists([self.builder.prompt_ids(h) for h in histories])

    def wide_beam(self, histories: Sequence[Sequence[int]], width: int, dead: torch.Tensor | None) -> Beams:
        return token_passes.wide_beam(self.model, self.trie, self.builder.code_offset, self._prompts(histories), width,
                                      dead)

    def leaf_logprobs(self, histories: Sequence[Sequence[int]], leaves: torch.Tensor) -> torch.Tensor:
        return token_passes.leaf_logprobs(self.model, self.trie, self.builder.code_offset, self._prompts(histories),
                                          leaves)


class TimelineRanker:
    """The item-level target: one timeline forward per batch of users, the decoder's searches (``model`` in eval
    mode, as ``TimelineModel.load`` gives it)."""

    batch_size = 256

    def __init__(self, model: TimelineModel, trie: CatalogTrie) -> None:
        self.model, self.trie = model, trie

    @property
    def max_history(self) -> int:
        return self.model.config.max_items

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def lists(self, users: Sequence[EvalUser], k: int, width: int, exclude_history: bool,
              prior: Any = None) -> dict[int, list[int]]:
        """user id -> the top k of a search of max(k, width) beams (the first k read, as served); ``prior`` fused
        when its weight is > 0."""
        fuse = prior is not None and prior.settings.weight > 0
        out: dict[int, list[int]] = {}
        for s in range(0, len(users), self.batch_size):
            part = users[s : s + self.batch_size]
            histories = [u.history for u in part]
            dead = self.trie.dead_nodes(histories) if exclude_history else None
            fused = prior_log_mass(self.trie, prior.probs(histories), prior.settings.weight) if fuse else None
            res = beam_search(self.model, self.trie, user_states(self.model, self.trie, histories),
                              max(k, width), dead, fused)
            for u, row in zip(part, res.leaves[:, :k].tolist(), strict=True):
                out[u.user_id] = self.trie.items_of_leaves([x for x in row if x >= 0],
                                                           u.history if exclude_history else ())
        return out

    @torch.inference_mode()
    def wide_beam(self, histories: Sequence[Sequence[int]], width: int, dead: torch.Tensor | None) -> Beams:
        res = beam_search(self.model, self.trie, user_states(self.model, self.trie, histories), width, dead,
                          trace=True)
        return partial_sums(list(res.steps), self.trie.levels)

    @torch.inference_mode()
    def leaf_logprobs(self, histories: Sequence[Sequence[int]], leaves: torch.Tensor) -> torch.Tensor:
        """[B, n] leaves (-1: none) -> [B, n, L] partial sums of each leaf's code log-probs (-inf at -1)."""
        b, n = leaves.shape
        ok = leaves >= 0
        codes = self.trie.node_code[self.trie.ancestors[leaves.clamp(min=0)]].clamp(min=0)  # [B, n, L]
        states = user_states(self.model, self.trie, histories).repeat_interleave(n, 0)  # [B * n, H]
        sums = self.model.path_code_logprobs(states, codes.reshape(b * n, -1)).cumsum(1).view(b, n, -1)
        return torch.where(ok[..., None], sums, torch.full_like(sums, float("-inf")))


def is_timeline(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds an item-level target (else: a token target's transformers directory)."""
    return (Path(model_dir) / CONFIG_FILE).is_file()


def ranker_of(bundle: Any, model_dir: Path, ids: Any, dtype: str = "auto") -> TargetRanker:
    """The ranker of ``bundle``'s target in ``model_dir`` (its train-only or its served target: an item-level or a
    token target) over the catalog of ``ids`` (``SemanticIds``)."""
    trie = CatalogTrie(ids)
    if is_timeline(model_dir):
        return TimelineRanker(TimelineModel.load(model_dir), trie)
    from recsvc.bundle.loading import load_causal_lm
    from training.evaluation.ranking import serving_model

    return TokenRanker(serving_model(load_causal_lm(model_dir, dtype=dtype)), bundle.prompt_builder(ids=ids), trie)
