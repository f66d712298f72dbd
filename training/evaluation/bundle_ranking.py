"""One bundle's served lists for offline evaluation: ``rank_bundle`` ranks a split's users as the bundle is
served (its target, fused prior, dense head and fresh slots, each of which can be left out) and returns the
lists with what scoring them needs (users, cold items, fitting period). ``recsvc eval`` scores them beside the
baselines (``training.evaluation.evaluate.evaluate_bundle``) and, with ``--against``, beside a second bundle's lists
ranked by the same call (``training.evaluation.compare``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI reads VARIANTS and Parts without loading torch
    from recsvc.content.fresh import FreshItems
    from recsvc.data.split import EvalUser, SplitData
    from recsvc.priors.mixed import MixedPrior
    from recsvc.priors.transition import TransitionPrior
    from tokenizer_rqvae.ids import SemanticIds

VARIANTS = ("no-prior", "no-dense", "no-slots")  # a part of a bundle left out (``Parts.without``)


@dataclass(frozen=True)
class Parts:
    """Which of the served parts beside the target's beams are used (each only where the bundle has it)."""

    prior: bool = True  # BUNDLE/prior fused into the search
    dense: bool = True  # the target's dense head merged with the beams
    fresh: bool = True  # BUNDLE/fresh's slots at the lists' tails

    def without(self, variant: str | None) -> Parts:
        """These parts less the one a variant ("no-prior", "no-dense", "no-slots") names; None: unchanged."""
        if variant is None:
            return self
        field = {"no-prior": "prior", "no-dense": "dense", "no-slots": "fresh"}[variant]
        return replace(self, **{field: False})


@dataclass(frozen=True)
class Ranked:
    """A bundle's lists of one split's users. ``rankings``: the model's own lists (beams, fused prior and dense
    head as used), without fresh slots; ``lists(k)``: what is served, read at k (with the slots when used)."""

    root: Path
    data: SplitData
    data_dir: Path
    split: str
    users: list[EvalUser]
    ids: SemanticIds
    protocol: str
    fit_on: str  # "train" | "train+valid"
    cold: set[int]  # catalog items nobody interacted with in fit_on
    exclude_history: bool
    rankings: dict[int, list[int]]
    fresh: FreshItems | None
    candidates: dict[int, list[tuple[int, float]]] | None  # each user's fresh candidates (slots > 0)
    prior: TransitionPrior | MixedPrior | None
    prior_dir: Path
    dense: dict[str, Any] | None  # the dense head's settings and whether it merged
    train_only: bool  # the paper protocol read from a deploy bundle: BUNDLE/target-train
    width: int
    seconds: float
    world: int

    def lists(self, k: int) -> dict[int, list[int]]:
        """Each user's served list read at k (the fresh slots take its tail when the bundle has them)."""
        from training.evaluation.fresh import fresh_lists

        return fresh_lists(self.fresh, self.rankings, self.users, self.exclude_history, self.candidates)(k)

    def without_slots(self) -> Ranked:
        """The same lists without the fresh slots (no ranking again)."""
        return replace(self, fresh=None, candidates=None)

    @property
    def has_slots(self) -> bool:
        return self.fresh is not None and self.fresh.settings.slots > 0


def rank_bundle(
    bundle_dir: str | Path, split: str, ks: Sequence[int], data_dir: str | Path | None = None, dtype: str = "auto",
    batch_size: int = 32, max_users: int | None = None, exclude_history: bool = False, seed: int = 0,
    parts: Parts = Parts(), protocol: str | None = None,
) -> Ranked | None:
    """Rank ``split``'s users (all, or a ``max_users`` sample drawn with ``seed``) with the bundle as served, every
    cutoff read from one search at the served width (or max(ks)).

    ``protocol`` (default: the bundle's): "paper" on a deploy-protocol bundle ranks with what was trained on the
    train period alone (BUNDLE/target-train, and the bundle's prior settings refitted on train); "deploy" on a paper
    bundle is refused (its target never saw valid). Under an initialised torch.distributed group the users'
    batches are sharded and the rankings gathered; ranks other than 0 return None."""
    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.loading import load_causal_lm
    from recsvc.content.dense_head import DenseRetriever, has_dense_head
    from recsvc.content.fresh import FreshItems
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.errors import UserError
    from recsvc.priors.mixed import MixedPrior, SequenceModel, load_prior
    from recsvc.priors.transition import TransitionPrior
    from recsvc.recommender.prior_ranked import ranks_alone
    from recsvc.timeline.model import TimelineModel
    from tokenizer_rqvae.trie import CatalogTrie
    from training.baselines.base import fit_period
    from training.baselines.prior_alone import prior_rankings
    from training.evaluation.fresh import cold_items, fresh_candidates, fresh_candidates_by_user
    from training.evaluation.rankers import TimelineRanker, is_timeline
    from training.evaluation.ranking import (
        dist_rank_world,
        gather_rankings,
        period_catalog_rows,
        rank_users,
        serving_model,
    )

    bundle = Bundle.open(bundle_dir)
    data_path = bundle.resolve_data_dir(data_dir)
    data = load_split_dir(data_path)
    ids = bundle.load_ids()
    trained = bundle.read().get("protocol", "paper")
    protocol = protocol or trained
    if protocol == "deploy" and trained != "deploy":
        raise UserError(f"bundle {bundle.root} was trained on the train period only (paper protocol): build it with "
                        "--protocol deploy to evaluate the deploy protocol")
    train_only = protocol == "paper" and trained == "deploy"
    model_dir = bundle.train_only_target_dir if train_only else bundle.target_dir
    timeline = is_timeline(model_dir)  # the item-level target (bundle.json "architecture": "items")
    model = None if timeline else load_causal_lm(model_dir, dtype=dtype)
    # the dense head beside the beams, when trained and tuned (``recsvc tune dense``)
    dense = DenseRetriever.load(model_dir, ids) if parts.dense and has_dense_head(model_dir) else None
    if dense is not None and split != "test":  # the catalog of that time (the rule of ``fresh_candidates``)
        dense = dense.within(period_catalog_rows(data, split, ids))
    users = sample_users(data.eval_users(split), max_users, seed)
    start = time.perf_counter()
    prior_dir = bundle.prior_dir_for(exclude_history)  # as the service fuses it (BUNDLE/prior-excl when excluding)
    prior = load_prior(prior_dir) if parts.prior and bundle.has_prior(exclude_history) else None
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
    if ranks_alone(prior):  # the bundle serves its prior's ranking (recsvc tune mix chose it on validation)
        assert prior is not None
        rankings = prior_rankings(prior, users, max(ks), exclude_history) if rank == 0 else {}
    elif timeline:
        ranker = TimelineRanker(TimelineModel.load(model_dir), CatalogTrie(ids))
        rankings = ranker.lists(users, max(ks), width, exclude_history, prior) if rank == 0 else {}
    else:
        rankings = rank_users(serving_model(model), bundle.prompt_builder(ids=ids), CatalogTrie(ids), users,
                              max(ks), batch_size, exclude_history, progress=rank == 0, prior=prior,
                              shard=(rank, world) if world > 1 else None, beam_width=width, dense=dense)
    rankings = gather_rankings(rankings)
    seconds = time.perf_counter() - start
    if rank != 0:
        return None
    if len(rankings) != len(users):
        raise RuntimeError(f"gathered {len(rankings)} rankings for {len(users)} users")
    # cold / warm slices: targets never interacted with in the fitting period, and the rest
    fit_on = fit_period(protocol, split)
    fresh = None
    if parts.fresh and bundle.has_fresh():  # fresh items recounted on this evaluation's fitting period
        fresh = FreshItems.load(bundle.fresh_dir, period=fit_on).with_fresh(
            sorted(fresh_candidates(data, split, fit_on, ids.item_ids.tolist())), fit_on)
    # each user's fresh candidates, once: the model's lists and the prior-alone lists take the same slots
    cands = (fresh_candidates_by_user(fresh, users, fresh.settings.slots, exclude_history)
             if fresh is not None and fresh.settings.slots > 0 else None)
    return Ranked(root=bundle.root, data=data, data_dir=data_path, split=split, users=list(users), ids=ids,
                  protocol=protocol, fit_on=fit_on, cold=cold_items(data, fit_on, ids.item_ids.tolist()),
                  exclude_history=exclude_history, rankings=rankings, fresh=fresh, candidates=cands, prior=prior,
                  prior_dir=prior_dir, dense=({**asdict(dense.settings), "active": dense.active}
                                              if dense is not None else None),
                  train_only=train_only, width=width, seconds=seconds, world=world)
