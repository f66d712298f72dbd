"""Offline evaluation: rank users' next items with the engine's beam search, score Recall/NDCG@K.

One beam search with K = max(ks) per user gives the ranking every cutoff is read from (LC-Rec's protocol:
num_beams = 20 for @5/@10/@20). Items are not filtered against the history unless asked (the paper's
protocol keeps them). The popularity baseline ranks by interaction counts in the periods before the split.
A bundle's transition prior (BUNDLE/prior, weight > 0) is fused into the beam search as the service fuses it
(``recsvc.engine.prior``), each user's prior computed from that user's history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsvc.bundle.prompt import PromptBuilder
from recsvc.content.dense_head import DenseRetriever, has_dense_head, last_hidden
from recsvc.content.fresh import FreshItems
from recsvc.data.metrics import evaluate_rankings, popularity_rankings, score_lists
from recsvc.data.sampling import sample_users
from recsvc.data.split import EvalUser, SplitData
from recsvc.engine.beam_search import BeamSearch
from recsvc.engine.engine_model import EngineModel
from recsvc.engine.prior import prior_log_mass
from recsvc.engine.prompts import PromptBatch
from recsvc.errors import UserError
from recsvc.hardware import resolve_dtype
from recsvc.priors.mixed import MixedPrior, SequenceModel, load_prior
from recsvc.priors.transition import TransitionPrior
from recsvc.progress import progress_bar
from recsvc.recommender.prior_ranked import ranks_alone
from tokenizer_rqvae.trie import CatalogTrie
from training.fresh_eval import cold_items, fresh_candidates, fresh_candidates_by_user, fresh_lists, paired_effect

DEFAULT_EVAL_KS = (1, 5, 10, 20)


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
        res = engine.search(prompts, width, dead, fused, top=top)  # leaves [B, k]
        sims = (dense.similarities(last_hidden(model.model, [builder.prompt_ids(u.history) for u in chunk]))
                if merging else None)
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
    interacted with by the end of the period otherwise (``training.fresh_eval.fresh_candidates``' rule)."""
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


def make_evaluator(builder: PromptBuilder, data: SplitData, split: str = "valid", k: int = 10,
                   ks: Sequence[int] = (10,), max_users: int | None = 2000, batch_size: int = 64,
                   seed: int = 0, prior: TransitionPrior | None = None) -> Callable[[Any], dict[str, float]]:
    """For early stopping during training: model -> {"recall@10": ..., "ndcg@10": ...} on a fixed sample
    (with ``prior``: of the prior-fused beam search)."""
    users = sample_users(data.eval_users(split), max_users, seed)
    trie = CatalogTrie(builder.ids)

    def evaluate(model: Any) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            rankings = rank_users(serving_model(model), builder, trie, users, max(k, *ks), batch_size,
                                  progress=False, prior=prior)  # rebuilt per call: training changed the weights
        finally:
            model.train(was_training)
        return evaluate_rankings(rankings, users, ks)

    return evaluate


def evaluate_bundle(
    bundle_dir: str | Path, split: str = "test", ks: Sequence[int] = DEFAULT_EVAL_KS,
    data_dir: str | Path | None = None,
    dtype: str = "auto", batch_size: int = 32, max_users: int | None = None, exclude_history: bool = False,
    seed: int = 0, use_prior: bool = True,
    baselines: Sequence[str] = (), protocol: str | None = None, baseline_options: dict[str, Any] | None = None,
    use_fresh: bool = True, use_dense: bool = True,
) -> dict[str, Any] | None:
    """Model and popularity metrics on a split: {"model": {...}, "popularity": {...}, "users": n, ...,
    "prior": {settings..., "fitted_on"} of the fused BUNDLE/prior, or None (none, weight 0, or not use_prior)}.

    ``protocol`` (default: the bundle's): "paper" on a deploy-protocol bundle evaluates what was trained on the
    train period alone (BUNDLE/target-train, and the bundle's prior settings refitted on train), so one bundle
    gives both protocols' figures; "deploy" on a paper bundle is refused (its target never saw valid).

    Under an initialised torch.distributed group (``torchrun``/``accelerate launch``; ``recsvc eval`` sets it up
    when WORLD_SIZE > 1) the users' batches are sharded across the processes, the rankings gathered, and rank 0
    alone scores them (and the baselines) and returns the result; the other ranks return None."""
    import time

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.loading import load_causal_lm
    from recsvc.data.split import load_split_dir
    from recsvc.errors import UserError

    bundle = Bundle.open(bundle_dir)
    data_path = bundle.resolve_data_dir(data_dir)
    data = load_split_dir(data_path)
    ids = bundle.load_ids()
    builder = bundle.prompt_builder(ids=ids)
    trained = bundle.read().get("protocol", "paper")
    protocol = protocol or trained
    if protocol == "deploy" and trained != "deploy":
        raise UserError(f"bundle {bundle.root} was trained on the train period only (paper protocol): build it with "
                        "--protocol deploy to evaluate the deploy protocol")
    train_only = protocol == "paper" and trained == "deploy"
    model_dir = bundle.train_only_target_dir if train_only else bundle.target_dir
    model = load_causal_lm(model_dir, dtype=dtype)
    # the dense head beside the beams, when trained and tuned (``recsvc tune dense``)
    dense = DenseRetriever.load(model_dir, ids) if use_dense and has_dense_head(model_dir) else None
    if dense is not None and split != "test":  # the catalog of that time (the rule of ``fresh_candidates``)
        dense = dense.within(period_catalog_rows(data, split, ids))
    users = sample_users(data.eval_users(split), max_users, seed)
    start = time.perf_counter()
    prior_dir = bundle.prior_dir_for(exclude_history)  # as the service fuses it (BUNDLE/prior-excl when excluding)
    prior = load_prior(prior_dir) if use_prior and bundle.has_prior(exclude_history) else None
    if prior is not None and prior.settings.weight <= 0:
        prior = None
    if prior is not None and train_only:  # the same settings, counted (and SASRec fitted) on the train period
        counted = TransitionPrior.fit(data.train.values(), ids.item_ids.tolist(), prior.settings, fitted_on="train")
        if isinstance(prior, MixedPrior):
            seq_train = prior_dir / "sequence-train"
            if not seq_train.is_dir():
                raise UserError(f"{prior_dir} mixes a SASRec but has no train-period one ({seq_train}): re-run "
                                "`recsvc tune mix`")
            prior = MixedPrior(counted, SequenceModel.load(seq_train), prior.mix)
        else:
            prior = counted
    rank, world = dist_rank_world()
    width = bundle.served_beam_width()  # every cutoff is read from one search at the served width (or max(ks))
    from training.prior_alone import prior_rankings

    if ranks_alone(prior):  # the bundle serves its prior's ranking (recsvc tune mix chose it on validation)
        assert prior is not None
        rankings = prior_rankings(prior, users, max(ks), exclude_history) if rank == 0 else {}
    else:
        rankings = rank_users(serving_model(model), builder, CatalogTrie(ids), users, max(ks), batch_size,
                              exclude_history, progress=rank == 0, prior=prior,
                              shard=(rank, world) if world > 1 else None, beam_width=width, dense=dense)
    rankings = gather_rankings(rankings)
    seconds = time.perf_counter() - start
    if rank != 0:
        return None
    if len(rankings) != len(users):
        raise RuntimeError(f"gathered {len(rankings)} rankings for {len(users)} users")
    pop = popularity_rankings(data.item_popularity(split), users, max(ks), exclude_history)
    # cold / warm slices: targets never interacted with in the fitting period, and the rest
    from training.baselines.base import fit_period

    fit_on = fit_period(protocol, split)
    cold = cold_items(data, fit_on, ids.item_ids.tolist())
    fresh = None
    if use_fresh and bundle.has_fresh():  # fresh items recounted on this evaluation's fitting period
        fresh = FreshItems.load(bundle.fresh_dir, period=fit_on).with_fresh(
            sorted(fresh_candidates(data, split, fit_on, ids.item_ids.tolist())), fit_on)
    # each user's fresh candidates, once: the model's lists and the prior-alone lists take the same slots
    cands = (fresh_candidates_by_user(fresh, users, fresh.settings.slots, exclude_history)
             if fresh is not None and fresh.settings.slots > 0 else None)
    at_k = fresh_lists(fresh, rankings, users, exclude_history, cands)
    lists = {k: at_k(k) for k in ks}  # the lists read at each cutoff (merged once)
    model_metrics = score_lists(lists.__getitem__, users, ks, cold)
    # baselines beside the model (training/baselines): same users, metric code and history exclusion;
    # protocol default = the bundle's recorded one. Adds {"protocol": ..., "baselines": {name: {...}}}.
    from training.baselines import evaluate_baselines

    alone = (rankings if ranks_alone(prior)  # the served ranking is the prior's own: not ranked again
             else prior_rankings(prior, users, max(ks), exclude_history) if prior is not None else None)

    compared: dict[str, Any] = {}  # each baseline's lists, for the paired lead below
    beside = evaluate_baselines(data, split, ks, baselines, protocol, users, exclude_history,
                                cold=cold, fresh=fresh, lists_out=compared, **(baseline_options or {}))
    alone_slots = fresh_lists(fresh, alone, users, exclude_history, cands) if alone is not None else None
    if alone_slots is not None:  # what the generative model adds over the distribution it fuses (same fresh slots)
        compared["prior_alone"] = alone_slots
    from training.lead import leads
    return {
        "split": split, "users": len(users), "ks": list(ks), "dtype": resolve_dtype(dtype),
        "beam_width": None if ranks_alone(prior) else max(max(ks), width),
        "target": "target-train" if train_only else "target",
        "exclude_history": exclude_history,
        "model": model_metrics, "popularity": evaluate_rankings(pop, users, ks),
        "model_without_fresh": score_lists(lambda k: rankings, users, ks, cold) if fresh is not None else None,
        "fresh_effect": ({f"{part}@{k}": paired_effect(lists[k], rankings, users, k, cold, part == "cold")
                          for k in ks for part in ("cold", "warm")} if fresh is not None else None),
        # the fused distribution alone (what the generative model adds: "model" against these), with and
        # without the same fresh slots
        "prior_alone": score_lists(lambda k: alone, users, ks, cold) if alone is not None else None,
        "prior_alone_fresh": (score_lists(alone_slots, users, ks, cold)
                              if alone_slots is not None and fresh is not None else None),
        # the model against each baseline, user by user: ratio of means with a 95% paired bootstrap interval
        "lead": leads(lists.__getitem__, compared, users, ks),
        "cold_items": len(cold), "fit_on": fit_on,
        "fresh": ({**asdict(fresh.settings), "fresh_items": len(fresh)} if fresh is not None else None),
        "dense": ({**asdict(dense.settings), "active": dense.active} if dense is not None else None),
        "seconds": round(seconds, 1), "ms_per_user": round(1000 * seconds / max(1, len(users)), 2),
        "processes": world,
        "prior": ({**asdict(prior.settings), "fitted_on": prior.fitted_on, "dir": prior_dir.name,
                   **(asdict(prior.mix) if isinstance(prior, MixedPrior) else {})}
                  if prior is not None else None),
        **beside,
    }
