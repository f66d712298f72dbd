"""Ranking a split's users with a target: constrained beam search over the period's catalog rows, optionally
sharded across a torch.distributed group (the primitives under ``recsvc eval``, validation and the tunings)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from recsvc.bundle.prompt import PromptBuilder
from recsvc.content.dense_head import DenseRetriever
from recsvc.data.split import EvalUser, SplitData
from recsvc.engine.caches.prompts import PromptBatch
from recsvc.engine.entry.dispatch import decode
from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.engine.search.beam_search import BeamSearch
from recsvc.errors import UserError
from recsvc.priors.mixed import MixedPrior
from recsvc.priors.transition import TransitionPrior
from recsvc_base.progress import progress_bar
from tokenizer_rqvae.trie import CatalogTrie


@torch.inference_mode()
def rank_users(
    model: EngineModel, builder: PromptBuilder, trie: CatalogTrie, users: Sequence[EvalUser], k: int,
    batch_size: int = 32, exclude_history: bool = False, progress: bool = True,
    prior: TransitionPrior | MixedPrior | None = None, shard: tuple[int, int] | None = None,
    beam_width: int = 0, dense: DenseRetriever | None = None,
) -> dict[int, list[int]]:
    """user_id -> the engine's top-k item ids (plain constrained beam search; with ``prior`` of weight > 0 the
    prior is fused, each user's from its history). ``model``: ``EngineModel.build(model, "fp32")`` is what the
    service runs (``serving_model``). ``beam_width``: beams searched (the served width, ``Bundle.served_beam_width``;
    max(k, beam_width) are searched and the first k read, as the service reads its top-k; 0: k beams).

    ``shard=(rank, world)``: rank only the batches ``i`` with ``i % world == rank``, the batches built exactly as
    without sharding (same order, same composition, so the same padding), so the union over ranks equals the
    single-process result user for user.

    ``dense``: the target's dense head (``recsvc.content.dense_head``), active when its blend is > 0: the search's
    whole width and the head's nearest items are ranked together (``DenseRetriever.merge``), as the service does."""
    engine = BeamSearch(model, trie, builder.code_offset)
    fuse = prior is not None and prior.settings.weight > 0
    if fuse and not np.array_equal(prior.item_ids, trie.ids.item_ids):
        raise UserError("the transition prior was fitted on another catalog: refit it (`recsvc prior fit`)")
    out: dict[int, list[int]] = {}
    # similar prompt lengths together: less padding per batch
    order = sorted(users, key=lambda u: min(len(u.history), builder.max_history))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shard is not None:
        rank, world = shard
        batches = batches[rank::world]
    width = max(k, beam_width)
    top = k if width > k else None  # the first k of a wider search, as a server reads its top-k
    merging = dense is not None and dense.active
    if merging:
        top = None  # every beam of the width competes with the head's items
    for chunk in progress_bar(batches, desc=f"rank@{k}", unit="batch", enabled=progress, leave=False):
        prompts = PromptBatch.from_lists([builder.prompt_ids(u.history) for u in chunk])
        excluded = [u.history for u in chunk] if exclude_history else None
        dead = trie.dead_nodes(excluded) if excluded else None
        fused = (prior_log_mass(trie, torch.from_numpy(prior.probs([u.history for u in chunk])),
                                prior.settings.weight) if fuse else None)
        res = decode(engine, None, prompts, [u.history for u in chunk], "plain", width, (0, 0), dead=dead, prior=fused,
                     top=top)  # leaves [B, k] (the decoding entry the server uses)
        sims = None
        if merging:  # the head's query as served: the decoding prefill's hidden state [B, H] (plain returns it)
            assert res.prompt_hidden is not None
            sims = dense.similarities(res.prompt_hidden)
        for r, u in enumerate(chunk):
            ok = res.leaves[r] >= 0
            items = trie.leaf_items(res.leaves[r][ok], excluded[r] if excluded else ())
            if sims is not None:
                assert dense is not None
                items = dense.merge(items, res.scores[r][ok].tolist(), sims[r], trie.ids, k,
                                    excluded[r] if excluded else ())[0]
            out[u.user_id] = items
    return out


def period_catalog_rows(data: SplitData, split: str, ids) -> list[int]:
    """The rows of the items the catalog holds when ``split`` is served: the whole catalog for test, the items
    interacted with by the end of the period otherwise (``training.evaluation.fresh.fresh_candidates``' rule)."""
    if split == "test":
        return list(range(len(ids)))
    present = {i for seq in data.sequences("train").values() for i in seq} | {i for seq in data.valid.values()
                                                                               for i in seq}
    return sorted(ids.index_of(i) for i in present if i in ids)


def dist_rank_world() -> tuple[int, int]:
    """(rank, world size) of an initialised torch.distributed group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_rankings(rankings: dict[int, list[int]]) -> dict[int, list[int]]:
    """Every rank's {user_id: ranked item ids} merged (all_gather_object; identity without a process group)."""
    import torch.distributed as dist

    rank, world = dist_rank_world()
    if world == 1:
        return rankings
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, rankings)
    merged: dict[int, list[int]] = {}
    for part in parts:
        merged.update(part)
    return merged


def serving_model(model: Any) -> EngineModel:
    """A transformers model as the service runs it: the engine's "fp32" attention mode."""
    return EngineModel.build(model, "fp32")


def model_ranker(builder: PromptBuilder, users: Sequence[EvalUser], k: int, batch_size: int = 64,
                 prior: TransitionPrior | MixedPrior | None = None) -> Callable[[Any], dict[int, list[int]]]:
    """model -> its top-k lists for ``users`` (``rank_users`` as served, ``prior`` fused when given), for
    validation during training: the engine model is rebuilt per call (training changed the weights) and the model
    is left in the mode it was in."""
    trie = CatalogTrie(builder.ids)

    def rank(model: Any) -> dict[int, list[int]]:
        was_training = model.training
        model.eval()
        try:
            return rank_users(serving_model(model), builder, trie, users, k, batch_size, progress=False, prior=prior)
        finally:
            model.train(was_training)

    return rank
