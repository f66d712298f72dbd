"""Offline evaluation: rank users' next items with the engine's beam search, score Recall/NDCG@K.

One beam search with K = max(ks) per user gives the ranking every cutoff is read from (LC-Rec's protocol:
num_beams = 20 for @5/@10/@20). Items are not filtered against the history unless asked (the paper's
protocol keeps them). The popularity baseline ranks by interaction counts in the periods before the split.
A bundle's transition prior (BUNDLE/prior, weight > 0) is fused into the beam search as the service fuses it
(``recsvc.engine.scoring.prior``), each user's prior computed from that user's history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from recsvc.bundle.prompt import PromptBuilder
from recsvc.data.metrics import evaluate_rankings, popularity_rankings, score_lists
from recsvc.data.sampling import sample_users
from recsvc.data.split import SplitData
from recsvc.errors import UserError
from recsvc.hardware import resolve_dtype
from recsvc.priors.mixed import MixedPrior
from recsvc.priors.transition import TransitionPrior
from recsvc.recommender.prior_ranked import ranks_alone
from training.evaluation.bundle_ranking import Parts, Ranked, rank_bundle
from training.evaluation.compare import Against, against_block, check_variant
from training.evaluation.fresh import fresh_lists, paired_effect
from training.evaluation.headline import headline
from training.evaluation.paired import pair_record, per_user_payload, slice_parts, slice_scores
from training.evaluation.ranking import model_ranker

DEFAULT_EVAL_KS = (1, 5, 10, 20)


def make_evaluator(builder: PromptBuilder, data: SplitData, split: str = "valid", k: int = 10,
                   ks: Sequence[int] = (10,), max_users: int | None = 2000, batch_size: int = 64,
                   seed: int = 0, prior: TransitionPrior | None = None) -> Callable[[Any], dict[str, float]]:
    """For early stopping during training: model -> {"recall@10": ..., "ndcg@10": ...} on a fixed sample
    (with ``prior``: of the prior-fused beam search)."""
    users = sample_users(data.eval_users(split), max_users, seed)
    rank = model_ranker(builder, users, max(k, *ks), batch_size, prior)
    return lambda model: evaluate_rankings(rank(model), users, ks)


def evaluate_bundle(
    bundle_dir: str | Path, split: str = "test", ks: Sequence[int] = DEFAULT_EVAL_KS,
    data_dir: str | Path | None = None,
    dtype: str = "auto", batch_size: int = 32, max_users: int | None = None, exclude_history: bool = False,
    seed: int = 0, use_prior: bool = True,
    baselines: Sequence[str] = (), protocol: str | None = None, baseline_options: dict[str, Any] | None = None,
    use_fresh: bool = True, use_dense: bool = True, against: Against | None = None,
) -> dict[str, Any] | None:
    """Model and popularity metrics on a split: {"model": {...}, "popularity": {...}, "users": n, ...,
    "prior": {settings..., "fitted_on"} of the fused BUNDLE/prior, or None (none, weight 0, or not use_prior)}.

    The lists come from ``training.evaluation.bundle_ranking.rank_bundle`` (its ``protocol`` rule: "paper" on a deploy
    bundle reads BUNDLE/target-train; "deploy" on a paper bundle is refused). Every method is compared with the served
    lists user by user on every user and on the cold / warm slices (``"paired"``, ``training.evaluation.paired``), each
    user's scores kept under ``"per_user"``; ``"headline"`` picks the figures read first
    (``training.evaluation.headline``).
    ``against``: a second bundle (or variant) ranked on the same users under the same rules, reported under
    ``"against"`` (``training.evaluation.compare``).

    Under an initialised torch.distributed group (``torchrun``/``accelerate launch``; ``recsvc eval`` sets it up
    when WORLD_SIZE > 1) the users' batches are sharded across the processes, the rankings gathered, and rank 0
    alone scores them (and the baselines) and returns the result; the other ranks return None."""
    from recsvc.bundle.directory import Bundle

    bundle = Bundle.open(bundle_dir)
    data_path = bundle.resolve_data_dir(data_dir)
    protocol = protocol or bundle.read().get("protocol", "paper")
    parts = Parts(prior=use_prior, dense=use_dense, fresh=use_fresh)
    if against is not None:  # refused before anything is ranked
        check_variant(against, exclude_history, protocol)

    def rank(root: str | Path, used: Parts) -> Ranked | None:
        return rank_bundle(root, split, ks, data_path, dtype, batch_size, max_users, exclude_history, seed, used,
                           protocol)

    a = rank(bundle_dir, parts)
    b = None
    if against is not None and not (against.variant == "no-slots" and against.same_bundle(bundle_dir)):
        b = rank(against.bundle, parts.without(against.variant))  # every process of a sharded run takes part
    if a is None:  # a sharded run's other ranks: rank 0 reports
        return None
    if against is not None and b is None:  # the same bundle without its slots: its own lists, not ranked again
        b = a.without_slots()
    users, cold, fresh, prior = a.users, a.cold, a.fresh, a.prior
    lists = {k: a.lists(k) for k in ks}  # the lists read at each cutoff (merged once)
    model_metrics = score_lists(lists.__getitem__, users, ks, cold)
    pop = popularity_rankings(a.data.item_popularity(split), users, max(ks), exclude_history)
    # baselines beside the model (training/baselines): same users, metric code and history exclusion;
    # protocol default = the bundle's recorded one. Adds {"protocol": ..., "baselines": {name: {...}}}.
    from training.baselines.prior_alone import prior_rankings
    from training.evaluation.baselines import evaluate_baselines

    alone = (a.rankings if ranks_alone(prior)  # the served ranking is the prior's own: not ranked again
             else prior_rankings(prior, users, max(ks), exclude_history) if prior is not None else None)
    compared: dict[str, Any] = {}  # each baseline's lists, for the paired comparisons below
    beside = evaluate_baselines(a.data, split, ks, baselines, protocol, users, exclude_history,
                                cold=cold, fresh=fresh, lists_out=compared, **(baseline_options or {}))
    alone_slots = fresh_lists(fresh, alone, users, exclude_history, a.candidates) if alone is not None else None
    if alone_slots is not None:  # what the generative model adds over the distribution it fuses (same fresh slots)
        compared["prior_alone"] = alone_slots
    # every comparison user by user, on every user and on the cold / warm slices
    parts_users = slice_parts(users, cold)
    scored = {"model": slice_scores(lists.__getitem__, parts_users, ks)}
    pairs = [("model", name) for name in compared]
    if fresh is not None:  # the model's own lists (no slots) against the baselines without slots
        scored["model_without_fresh"] = slice_scores(lambda k: a.rankings, parts_users, ks)
        pairs += [("model_without_fresh", name) for name in beside["baselines"] if "+" not in name]
    for name, at in compared.items():
        scored[name] = slice_scores(at, parts_users, ks)
    if b is not None:
        if [u.user_id for u in b.users] != [u.user_id for u in users]:
            raise UserError(f"--against {b.root}: ranked other users than {a.root} (another data directory?)")
        scored["against"] = slice_scores(b.lists, parts_users, ks)
        pairs.append(("model", "against"))
    paired = [pair_record(x, y, scored[x], scored[y]) for x, y in pairs]
    result = {
        "split": split, "users": len(users), "ks": list(ks), "dtype": resolve_dtype(dtype),
        "beam_width": None if ranks_alone(prior) else max(max(ks), a.width),
        "target": "target-train" if a.train_only else "target",
        "exclude_history": exclude_history,
        "model": model_metrics, "popularity": evaluate_rankings(pop, users, ks),
        "model_without_fresh": score_lists(lambda k: a.rankings, users, ks, cold) if fresh is not None else None,
        "fresh_effect": ({f"{part}@{k}": paired_effect(lists[k], a.rankings, users, k, cold, part == "cold")
                          for k in ks for part in ("cold", "warm")} if fresh is not None else None),
        # the fused distribution alone (what the generative model adds: "model" against these), with and
        # without the same fresh slots
        "prior_alone": score_lists(lambda k: alone, users, ks, cold) if alone is not None else None,
        "prior_alone_fresh": (score_lists(alone_slots, users, ks, cold)
                              if alone_slots is not None and fresh is not None else None),
        # the served lists against each baseline on every user: ratio of means with a 95% paired bootstrap interval
        "lead": {r["baseline"]: r["slices"]["all"] for r in paired if r["model"] == "model"
                 and r["baseline"] != "against"},
        "paired": paired,
        "cold_items": len(cold), "fit_on": a.fit_on,
        **served_parts(a),
        "seconds": round(a.seconds, 1), "ms_per_user": round(1000 * a.seconds / max(1, len(users)), 2),
        "processes": a.world,
        **beside,
    }
    if b is not None:
        assert against is not None
        result["against"] = against_block(against, b, parts.without(against.variant), paired[-1]["slices"],
                                          score_lists(b.lists, users, ks, cold), served_parts(b))
    if prior is not None:  # what the fused target added over this prior alone on validation, as its tuning measured
        key = "target_over_prior_excl" if a.prior_dir.name == "prior-excl" else "target_over_prior"
        result["target_over_prior"] = Bundle.open(bundle_dir).read().get(key)
    result["headline"] = headline(result)
    result["per_user"] = per_user_payload(parts_users, scored)
    return result


def served_parts(r: Ranked) -> dict[str, Any]:
    """What a bundle's lists held besides the target's beams: ``"fresh"``, ``"dense"``, ``"prior"`` (None: not used)."""
    fresh, prior = r.fresh, r.prior
    return {
        "fresh": ({**asdict(fresh.settings), "fresh_items": len(fresh)} if fresh is not None else None),
        "dense": r.dense,
        "prior": ({**asdict(prior.settings), "fitted_on": prior.fitted_on, "dir": r.prior_dir.name,
                   **(asdict(prior.mix) if isinstance(prior, MixedPrior) else {})}
                  if prior is not None else None),
    }
