"""``recsvc tune mix``: mix a SASRec's item distribution into the bundle's fused prior, chosen on validation.

    recsvc tune mix --bundle B [--trials 25] [--budget-minutes 15] [--users 1000] [--cache-dir DIR]

After ``recsvc tune prior`` (the transition settings are kept): SASRec is fitted on the train period (for the
search) and on the served target's periods (deploy: train + valid, the epoch count chosen on valid), both
through the baselines' cache, so ``recsvc eval --baselines sasrec`` with the same ``--cache-dir`` reuses them.
Optuna (TPE) searches the mix share, the SASRec softmax temperature, the product term's exponent and the fusion
weight on validation users ranked by the train-only target with the train-period priors; the first trial is the
transition prior alone (mix 0, product 0, its tuned weight), so the search can only keep or improve it.

The product term (``recsvc.priors.mixed``: P ∝ mixture * softmax(s) ** product, searched on [0, 1])
joined the mixture after the mixture alone kept SASRec out: on Beauty the search chose mix 0.005, although
SASRec alone ranks as well as the fused target. Measured before it joined (a one-off script, the recipe's
train-only target, all 4,295 validation users, transition settings and weight as tuned): product 0.1 / 0.2 /
0.3 / 0.4 against the tuned mixture, Recall@10 +0.0006 / +0.0012 / +0.0017 / +0.0011 (paired standard errors
0.0007-0.0010) on 0.0286, NDCG@10 +0.0003 / +0.0004 / +0.0004 / -0.0001 (0.0004-0.0005) on 0.0199.

The weight is searched as the prior's share s of the fused score, (1 - s) * log p_target + s * log P, which ranks
like log p_target + w * log P with w = s / (1 - s). s uniform on [0, W / (1 + W)] (W = ``--max-weight``, 30 by
default) puts three quarters of the trials at w <= 3 and leaves room for a prior that should dominate: a target
trained too briefly for its catalog. On Beauty, a target trained for one epoch chose w = 2.84 under the
earlier cap w <= 3 and w = 9.9 under a cap of 10 (docs/QUALITY.md).

Then the prior competes on its own: a second search (its own study) looks for the mixture and the transition
counts' window, decay and back-off that rank best by themselves on the same users, in two stages of ``--trials``
each (the mixture first, from SASRec alone, mix 1; then the transition settings under it). The transition settings
``recsvc tune prior`` chose were tuned for fusion with this target; the prior's own ranking, the reference of the
headline and the fallback the bundle may serve, searches its own. With ``--rank-by auto`` (the default), when
that ranking beats every fused trial, the prior is stored with ``alone`` set and the bundle serves its ranking
instead of the fused target's (``recsvc.recommender.prior_ranked``; ``recsvc eval`` and ``recsvc tune fresh``
rank the same way) with the transition settings of that search, and the command says that the target needs more
training. So what a bundle serves is, on validation, at least as good as its best fused search, its prior's best
ranking and SASRec alone. The record keeps both
figures (``valid``, ``valid_prior_alone``) and the decision (``rank_by``). The choice goes to BUNDLE/prior
(``recsvc.priors.mixed``: ``sequence/`` the served SASRec and mix.json, ``sequence-train/`` the
train-period SASRec the paper protocol's evaluation uses) and bundle.json ("prior" weight, "tuning"."mix").
``--exclude-history`` does the same for a service that never recommends history items: validation lists exclude
them, and the choice goes to BUNDLE/prior-excl (after ``recsvc tune prior --exclude-history``), bundle.json
"prior_excl" and "tuning"."mix_excl".

Trials re-score each user's cached candidates as ``recsvc tune prior``'s do (``training.tuning.rescore_study``; SASRec's
top ``--sequence-candidates`` items join them, and its scores over the catalog are computed once per run; a
trial recomputes the mixture over the catalog and its masses under the candidates' prefixes,
``training.tuning.rescore.DenseMasses``, to replay the served search); ``--full-decode`` decodes every trial. The
chosen fused settings are checked with one full decode, and the fused target's lists against the prior's own best
ranking (paired, validation) go to bundle.json "target_over_prior" (``-excl``) and ``recsvc eval``'s headline.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from recsvc.errors import UserError
from recsvc_base.progress import print_record
from training.choices import TUNING_METRICS
from training.tuning.args import add_bundle_args, add_run_args, add_search_args
from training.tuning.rescore_study import add_rescore_args

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

    from recsvc.bundle.directory import Bundle
    from recsvc.data.split import EvalUser
    from recsvc.priors.mixed import MixSettings, SequenceModel
    from recsvc.priors.transition import PriorSettings, TransitionPrior

TRAIN_SEQUENCE_DIR = "sequence-train"
MAX_WEIGHT = 30.0
SEQUENCE_CANDIDATES = 50  # SASRec's top items added to each user's cached candidates
PRODUCT_RANGE = (0.0, 1.0)  # the product term's exponent searched (1: SASRec weighs as much as the mixture)
MIX_KEYS = ("mix", "temperature", "product")  # a mixture's trial parameters (``suggest_mix``)


def register_mix(sub) -> None:
    p = sub.add_parser("mix", help="mix SASRec's item distribution into the fused prior (chosen on validation)")
    add_bundle_args(p)
    add_search_args(p, trials=25, metrics=TUNING_METRICS)
    p.add_argument("--max-weight", type=float, default=MAX_WEIGHT,
                   help="upper end of the fusion weight range (searched as the prior's share w / (1 + w))")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="fitted SASRec cache, shared with `recsvc eval` (default: BUNDLE/baselines)")
    p.add_argument("--sasrec-max-minutes", type=float, default=10.0)
    add_run_args(p)
    p.add_argument("--rank-by", choices=("auto", "fused", "prior"), default="auto",
                   help="auto: the prior ranks on its own when that beats every fused trial on validation; fused / "
                        "prior: force one (the record keeps both validation figures)")
    p.add_argument("--exclude-history", action="store_true",
                   help="tune BUNDLE/prior-excl, the prior of a service that excludes history items")
    add_rescore_args(p, sequence=SEQUENCE_CANDIDATES)
    p.set_defaults(func=cmd_tune_mix)


def cmd_tune_mix(args: argparse.Namespace) -> int:
    import torch

    from recsvc.bundle.directory import Bundle
    from recsvc.data.metrics import evaluate_rankings
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.priors.mixed import MixedPrior, SequenceModel
    from recsvc.priors.transition import MAX_WEIGHT as WEIGHT_LIMIT
    from recsvc.priors.transition import TransitionPrior
    from training.baselines.prior_alone import prior_rankings
    from training.baselines.sasrec import cache_dir_for, fit_sasrec
    from training.baselines.sasrec_train import SASRecSettings
    from training.evaluation.headline import format_target_over_prior
    from training.evaluation.rankers import ranker_of
    from training.tuning import rescore_study as rs
    from training.tuning.prior_cli import prior_sequences, resolve_fit_on
    from training.tuning.rescore import coverage
    from training.tuning.studies import (
        check_budget,
        run_staged,
        study,
        suggest_transition,
        validation_model,
        weights_fingerprint,
    )

    check_budget(args.trials, args.budget_minutes)
    widths = None if args.full_decode else rs.widths_of(args)  # refused before anything loads
    if not 0 < args.max_weight <= WEIGHT_LIMIT:
        raise UserError(f"--users must be >= 1 and --max-weight in (0, {WEIGHT_LIMIT:g}]")
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = Bundle.open(args.bundle)
    excl = bool(args.exclude_history)
    if not bundle.has_prior(excl) or (excl and bundle.prior_dir_for(True) == bundle.prior_dir):
        flag = " --exclude-history" if excl else ""
        raise UserError(f"{bundle.root} has no transition prior{' for exclusion' if excl else ''}: run "
                        f"`recsvc tune prior{flag}` first")
    prior_dir = bundle.prior_dir_for(excl)
    data = load_split_dir(bundle.resolve_data_dir(args.data))
    protocol, model_dir = validation_model(bundle, "the mix")
    fit_on = resolve_fit_on("auto", protocol)
    stored = fused_transition(bundle, excl, prior_dir)
    ids = bundle.load_ids()
    cache = args.cache_dir or bundle.root / "baselines"
    settings = SASRecSettings(max_minutes=args.sasrec_max_minutes).check()
    t0 = time.monotonic()
    for period in ("train", fit_on):  # fitted (or loaded from the cache) before the search
        fit_sasrec(data, period, settings, cache_dir=cache)
    train_dir, served_dir = (cache_dir_for(cache, data, p, settings) for p in ("train", fit_on))
    seq_train = SequenceModel.load(train_dir)
    train_prior = TransitionPrior.fit(data.train.values(), ids.item_ids.tolist(), stored,
                                      fitted_on="train")
    ranker = ranker_of(bundle, model_dir, ids, args.dtype)  # the token or item-level target, loaded once
    width = bundle.served_beam_width()  # the top-10 read from the served search, as a server reads it
    trie = ranker.trie
    users = sample_users(data.eval_users("valid"), args.users, args.seed)
    print(f"tune mix: {len(users)} validation users, model {model_dir.name}, transition {stored}, "
          f"metric {args.metric}{', history excluded' if excl else ''}")

    # what every trial's score depends on: a retrained target, a re-tuned transition prior, other SASRec fits or
    # other users start a new study instead of resuming one scored on another objective
    key = {"model": weights_fingerprint(model_dir), "sasrec": weights_fingerprint(train_dir),
           # the transition prior's own settings; its weight is searched here (and the stored one is a previous
           # run's choice once this command has written the mix)
           "transition": counts_of(stored),
           "data": str(bundle.resolve_data_dir(args.data)),
           "users": len(users), "seed": args.seed, "metric": args.metric, "exclude_history": excl,
           "dtype": str(ranker.dtype), "max_weight": args.max_weight, "beam_width": width,
           "family": {"mixture": True, "product": list(PRODUCT_RANGE)}}
    scorer, cache_info = None, None
    if widths is not None:  # each trial re-scores cached candidates: its own study (another objective)
        scorer, cache_info = rs.rescorer(bundle.root / "tune", "mix-excl" if excl else "mix", key, widths, ranker,
                                         trie, users, train_prior, excl, width, seq_train)
        key = {**key, "objective": f"rescored: {cache_info['ranking']}", "candidates": asdict(widths)}

    def objective(trial) -> float:
        mix = suggest_mix(trial)
        weight = weight_of({"share": trial.suggest_float("share", 0.0, share_of(args.max_weight))})
        settings = _with_weight(suggest_transition(trial), weight)
        start = time.perf_counter()
        if scorer is not None:
            m = scorer.evaluate(settings, mix)
        else:
            prior = MixedPrior(train_prior.with_settings(settings), seq_train, mix)
            m = evaluate_rankings(rs.decode_lists(ranker, users, excl, width, prior), users, (10,))
        trial.set_user_attr("seconds", time.perf_counter() - start)
        trial.set_user_attr("recall@10", m["recall@10"])
        trial.set_user_attr("ndcg@10", m["ndcg@10"])
        return m[args.metric]

    key = {**key, "family": {**key["family"], "transition": "staged"}}
    search = study(bundle.root / "tune" / ("mix-excl.db" if excl else "mix.db"), "mix", args.seed, key)
    counts = counts_of(stored)
    if not search.trials:  # the transition prior alone, as tuned
        search.enqueue_trial({"mix": 0.0, "temperature": 1.0, "product": 0.0,
                              "share": share_of(min(stored.weight, args.max_weight)), **counts})
    # stage 1: the mixture and the weight on the transition settings as tuned; stage 2: the transition settings and
    # the weight under the best mixture (``recsvc tune prior`` tuned them for fusion without SASRec)
    ran = run_staged(search, objective, counts, MIX_KEYS, args.trials, args.budget_minutes)
    best = search.best_trial
    first = search.trials[0]
    chosen = _with_weight(transition_of(best.params, stored), weight_of(best.params))
    own, ran_own, own_seconds = _search_alone(args, bundle, excl, train_prior, seq_train, users, chosen,
                                              best.params, {**key, "model": None, "fused": best.params})
    own_transition = transition_of(own.params, chosen)  # the prior's own counts settings, tuned for ranking
    # the chosen fused settings' full decode on validation: the check of the re-scored choice, and the fused lists
    # the headline figure compares with the prior's own best ranking
    fused_prior = MixedPrior(train_prior.with_settings(chosen), seq_train, mix_of(best.params))
    start = time.perf_counter()
    decoded = rs.decode_lists(ranker, users, excl, width, fused_prior)
    seconds = time.perf_counter() - start  # what one trial costs with --full-decode
    check = (rs.full_decode_check(decoded, scorer.lists(chosen, mix_of(best.params)), users, seconds,
                                  coverage(scorer, decoded)) if scorer else None)
    if check is not None:
        print(rs.format_check(check))
    alone_lists = prior_rankings(MixedPrior(train_prior.with_settings(own_transition), seq_train, mix_of(own.params)),
                                 users, 10, excl)
    headline = rs.target_over_prior(decoded, alone_lists, users, "tune mix", prior_dir.name)
    print(format_target_over_prior(headline))
    alone_wins = own.value > best.value if args.rank_by == "auto" else args.rank_by == "prior"
    pick = own if alone_wins else best
    mix = replace(mix_of(pick.params), alone=alone_wins)
    # the prior that ranks alone keeps its own transition settings (the fused search's weight, unused alone, stays)
    served_settings = own_transition if alone_wins else chosen
    served = TransitionPrior.fit(prior_sequences(data, fit_on), ids.item_ids.tolist(), served_settings,
                                 fitted_on=fit_on)
    MixedPrior(served, SequenceModel.load(served_dir), mix).save(prior_dir, served_dir)
    shutil.rmtree(prior_dir / TRAIN_SEQUENCE_DIR, ignore_errors=True)
    shutil.copytree(train_dir, prior_dir / TRAIN_SEQUENCE_DIR)
    record = {"settings": {**best.params, "weight": chosen.weight}, "transition": asdict(stored),
              "fit_on": fit_on,
              "valid_users": len(users), "metric": args.metric, "beam_width": width,
              "valid": {"recall@10": best.user_attrs["recall@10"], "ndcg@10": best.user_attrs["ndcg@10"]},
              "valid_transition_only": {"recall@10": first.user_attrs.get("recall@10"),
                                        "ndcg@10": first.user_attrs.get("ndcg@10")},
              "valid_prior_alone": {"settings": own.params, "transition": asdict(own_transition),
                                    "recall@10": own.user_attrs["recall@10"], "ndcg@10": own.user_attrs["ndcg@10"]},
              "rank_by": "prior" if alone_wins else "fused", "rank_by_rule": args.rank_by,
              "sasrec_cache": str(cache), "trials": len(search.trials), "trials_this_run": ran,
              "prior_alone_trials_this_run": ran_own, "prior_alone_seconds_per_trial": own_seconds,
              "seconds_this_run": round(time.monotonic() - t0, 1), "exclude_history": excl,
              "objective": "full decode" if scorer is None else "rescored",
              "seconds_per_trial": rs.per_trial(search, ran), "candidates": cache_info, "check": check,
              "target_over_prior": headline}
    meta = bundle.read()
    key = "prior_excl" if excl else "prior"
    bundle.update(**{key: {**meta.get(key, {}), **counts_of(served_settings), "weight": chosen.weight, "mix": mix.mix,
                           "temperature": mix.temperature, "product": mix.product,
                           "rank_by": record["rank_by"]}, f"target_over_{key}": headline},
                  tuning={**meta.get("tuning", {}), ("mix_excl" if excl else "mix"): record})
    print_record(record)
    if alone_wins:
        why = (f"on validation the prior's own ranking beats the fused target ({args.metric} {own.value:.4f} vs "
               f"{best.value:.4f})" if args.rank_by == "auto" else "--rank-by prior")
        print(f"note: {why}: the bundle now serves the prior's ranking, and the target adds nothing to it yet. "
              "Train the target longer or larger (recsvc build --max-minutes / --preset), then re-run the tuning.")
    return 0


def _search_alone(args: argparse.Namespace, bundle: Bundle, excl: bool, transition: TransitionPrior,
                  sequence: SequenceModel, users: Sequence[EvalUser], fused_transition: PriorSettings, fused: dict,
                  objective_key: dict) -> tuple[FrozenTrial, int, float | None]:
    """The prior's best ranking on its own, on the same validation users (Optuna, its own study
    BUNDLE/tune/mix-alone[-excl].db): its mixture and its transition counts' window, decay and back-off, searched
    for ranking alone rather than taken from the fused search (``recsvc tune prior`` tuned those for fusion with
    the target, which makes a weaker reference and a weaker fallback), ``trials`` trials for each. The first
    trials: SASRec alone, then the fused choice's mixture and transition settings. Returns (best trial, trials
    run now, their mean seconds: None when none ran)."""
    from recsvc.data.metrics import evaluate_rankings
    from recsvc.priors.mixed import MixedPrior
    from training.baselines.prior_alone import prior_rankings
    from training.tuning.rescore_study import per_trial
    from training.tuning.studies import run_staged, study, suggest_transition

    def objective(trial) -> float:
        start = time.perf_counter()
        counts = suggest_transition(trial)
        ranked = prior_rankings(MixedPrior(transition.with_settings(counts), sequence, suggest_mix(trial)), users, 10,
                                excl)
        m = evaluate_rankings(ranked, users, (10,))
        trial.set_user_attr("seconds", time.perf_counter() - start)
        trial.set_user_attr("recall@10", m["recall@10"])
        trial.set_user_attr("ndcg@10", m["ndcg@10"])
        return m[args.metric]

    search = study(bundle.root / "tune" / ("mix-alone-excl.db" if excl else "mix-alone.db"), "mix-alone", args.seed,
                   objective_key)
    counts = counts_of(fused_transition)
    if not search.trials:
        search.enqueue_trial({"mix": 1.0, "temperature": 1.0, "product": 0.0, **counts})  # SASRec alone
        search.enqueue_trial({**{k: fused[k] for k in MIX_KEYS}, **counts})
    ran = run_staged(search, objective, counts, MIX_KEYS, args.trials, args.budget_minutes)
    return search.best_trial, ran, per_trial(search, ran)


def fused_transition(bundle: Bundle, excl: bool, prior_dir: Path) -> PriorSettings:
    """The transition settings the fused search starts from: ``recsvc tune prior``'s choice. That is the stored
    prior's, unless the stored prior is the one a previous run of this command wrote (a mix, with transition
    settings it searched itself; a re-run of ``tune prior`` drops the mix); then the ones that run started from
    (its record's "transition")."""
    from recsvc.priors.mixed import MixedPrior, load_prior
    from recsvc.priors.transition import PriorSettings

    prior = load_prior(prior_dir)
    record = bundle.read().get("tuning", {}).get("mix_excl" if excl else "mix", {})
    if not isinstance(prior, MixedPrior) or "transition" not in record:
        return prior.settings
    base = PriorSettings(**record["transition"]).check()
    wrote = (record.get("valid_prior_alone", {}).get("transition") if record.get("rank_by") == "prior"
             else record.get("settings"))
    if counts_of(transition_of(wrote or {}, base)) != counts_of(prior.settings):
        return prior.settings  # the stored prior was refitted since (`recsvc prior fit`): start from it
    return base


def suggest_mix(trial) -> MixSettings:
    """A trial's mixture: mix share, temperature and the product term's exponent."""
    from recsvc.priors.mixed import MixSettings

    return MixSettings(mix=trial.suggest_float("mix", 0.0, 1.0),
                       temperature=trial.suggest_float("temperature", 0.25, 4.0, log=True),
                       product=trial.suggest_float("product", *PRODUCT_RANGE))


def counts_of(settings: PriorSettings) -> dict:
    """The transition counts' settings as trial parameters (``suggest_transition``'s names)."""
    return {"window": settings.window, "decay": settings.decay, "beta": settings.beta}


def transition_of(params: dict, base: PriorSettings) -> PriorSettings:
    """The transition settings of a trial's parameters, with ``base``'s weight (the fused search sets its own; a
    prior that ranks alone does not use one); a study from before these were searched keeps ``base``'s.

    >>> from recsvc.priors.transition import PriorSettings
    >>> transition_of({"window": 3, "decay": 0.5, "beta": 2.0, "mix": 1.0}, PriorSettings(weight=1.5))
    PriorSettings(window=3, decay=0.5, beta=2.0, weight=1.5)
    """
    if "window" not in params:
        return base
    return replace(base, window=int(params["window"]), decay=float(params["decay"]), beta=float(params["beta"]))


def mix_of(params: dict) -> MixSettings:
    """The mixture of a trial's parameters (``suggest_mix``'s; the study key keeps older studies apart).

    >>> mix_of({"mix": 0.5, "temperature": 2.0, "product": 0.25, "share": 0.5}).product
    0.25
    """
    from recsvc.priors.mixed import MixSettings

    return MixSettings(mix=float(params["mix"]), temperature=float(params["temperature"]),
                       product=float(params["product"]))


def share_of(weight: float) -> float:
    """The prior's share s of the fused score that ranks like weight w: s = w / (1 + w).

    >>> share_of(3.0)
    0.75
    """
    return float(weight) / (1.0 + float(weight))


def weight_of(params: dict) -> float:
    """The fusion weight of a trial's parameters: w = s / (1 - s) from the share s ("share"), or the weight itself
    (trials of studies from before the share, which searched "weight").

    >>> weight_of({"share": 0.75})
    3.0
    """
    if "share" in params:
        return float(params["share"]) / (1.0 - float(params["share"]))
    return float(params["weight"])


def _with_weight(settings, weight: float):
    return replace(settings, weight=float(weight))
