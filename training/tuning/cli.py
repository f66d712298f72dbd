"""Validation searches with Optuna: the served prior fusion, and the target's training settings.

    recsvc tune prior  --bundle B --trials 40 --budget-minutes 15 --users 1000
    recsvc tune target --data D --out DIR --trials 8 --budget-minutes 240 --trial-minutes 30
    recsvc tune fresh  --bundle B       (the fresh-item slots: training/tuning/fresh.py)
    recsvc tune mix    --bundle B       (SASRec mixed into the fused prior: training/tuning/mix.py)
    recsvc tune history --bundle B      (whether lists leave out the history items: training/tuning/history.py)

Both are resumable (an Optuna SQLite study next to the bundle: a re-run continues the same study, finished
trials are kept) and bounded (``--trials`` and ``--budget-minutes``, whichever comes first), and both write
the chosen settings into the bundle (bundle.json "tuning", and for ``prior`` BUNDLE/prior itself).

``prior``: the transition prior's settings (fusion weight, window, decay, back-off beta) are chosen on
validation users with the model that has not seen the valid period: BUNDLE/target-train for deploy-protocol
bundles, BUNDLE/target otherwise, and a prior fitted on the train period. The chosen settings are then fitted
on the periods the served target was trained on (deploy: train + valid) and written to BUNDLE/prior. With
``--exclude-history`` the search ranks with each user's history items excluded, as a service run with
``--exclude-history`` does, and writes BUNDLE/prior-excl (bundle.json "prior_excl"), which such a service and
``recsvc eval --exclude-history`` fuse instead of BUNDLE/prior.

A ``prior`` (and ``mix``) trial re-scores rather than re-decodes (``training.tuning.rescore_study``): each validation
user's candidates (the target's wide unfused beam and the prior's top items) and the target's log-probs of them
are computed once per study and stored beside it (BUNDLE/tune/candidates/, resumed part by part), and a trial
adds the prior's log-mass under its settings to those log-probs and ranks them, for every user at once (well
under a second on Beauty's 4,295 validation users, instead of a fused beam search over all of them). The chosen
settings are then decoded in full on validation once, and both figures printed and recorded ("check": the
re-scored and full-decode NDCG@10 / Recall@10 with standard errors, the share of users with the same top 10).
``--full-decode`` runs the search in every trial instead (its own study). Both write the headline figure
bundle.json "target_over_prior" (``-excl`` with ``--exclude-history``): the fused target's full decode against
the prior's own ranking on validation, paired.

``target``: each trial trains a target into DIR/target-<key>/trial-N (the paper protocol, validation Recall@10
each epoch, ``--trial-minutes`` each, the learning-rate schedule sized to the epochs that fit those minutes, so a
slower preset is judged annealed rather than cut mid-schedule) over learning rate, weight decay, history length
and preset; the best trial's settings go into DIR/best.json for the real build (``recsvc build ... --lr ...
--weight-decay ...``). Its study is keyed like the others: <key> is a digest of the data and ids files (sizes,
modification times), the epochs, the trial minutes, the presets, the validation users and the seed; a re-run
with any of them changed starts a new study in its own directory instead of resuming trials trained on other
inputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from recsvc_base.progress import print_record
from training.choices import TUNING_METRICS
from training.tuning.args import add_bundle_args, add_run_args, add_search_args
from training.tuning.rescore_study import add_rescore_args
from training.tuning.studies import check_budget as _check_budget
from training.tuning.studies import files_fingerprint, suggest_transition, validation_model, weights_fingerprint
from training.tuning.studies import run_trials as _run
from training.tuning.studies import study as _study

PRIOR_METRICS = TUNING_METRICS


def register(subparsers) -> None:
    tune = subparsers.add_parser("tune", help="validation searches (Optuna): prior fusion, target settings")
    sub = tune.add_subparsers(dest="tune_command", metavar="WHAT")
    p = sub.add_parser("prior", help="choose the transition prior's fusion settings on validation users")
    add_bundle_args(p)
    add_search_args(p, trials=40, metrics=PRIOR_METRICS)
    p.add_argument("--max-weight", type=float, default=2.0, help="upper end of the fusion weight range")
    p.add_argument("--exclude-history", action="store_true",
                   help="rank with the users' history items excluded (for services run with --exclude-history)")
    add_run_args(p)
    add_rescore_args(p)
    p.set_defaults(func=cmd_tune_prior)

    t = sub.add_parser("target", help="choose the target's training settings on validation Recall@10")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True, help="directory of the trial bundles and the study")
    t.add_argument("--ids", type=Path, required=True, help="semantic_ids.json (shared by every trial)")
    t.add_argument("--trials", type=int, default=8)
    t.add_argument("--budget-minutes", type=float, default=240.0)
    t.add_argument("--trial-minutes", type=float, default=30.0, help="training budget of one trial")
    t.add_argument("--epochs", type=int, default=8)
    t.add_argument("--presets", default="small", help="comma-separated presets to search over")
    t.add_argument("--recall-users", type=int, default=1000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None)
    t.set_defaults(func=cmd_tune_target)

    from training.tuning.capacity import register_capacity
    from training.tuning.dense import register_dense
    from training.tuning.fresh import register_fresh
    from training.tuning.fresh_signals import register_fresh_signals
    from training.tuning.history import register_history
    from training.tuning.mix import register_mix

    register_capacity(sub)
    register_dense(sub)
    register_fresh(sub)
    register_history(sub)
    register_fresh_signals(sub)
    register_mix(sub)


# ---------------------------------------------------------------------------------------------- prior
def cmd_tune_prior(args: argparse.Namespace) -> int:
    import torch

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.serving_files import missing_serving_files, write_serving_files
    from recsvc.data.metrics import evaluate_rankings
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.priors.transition import PriorSettings, TransitionPrior
    from training.baselines.prior_alone import prior_rankings
    from training.evaluation.headline import format_target_over_prior
    from training.evaluation.rankers import ranker_of
    from training.tuning import rescore_study as rs
    from training.tuning.prior_cli import prior_sequences, resolve_fit_on
    from training.tuning.rescore import coverage

    _check_budget(args.trials, args.budget_minutes)
    widths = None if args.full_decode else rs.widths_of(args)  # refused before anything loads
    if not 0 < args.max_weight <= 10:
        raise UserError("--users must be >= 1 and --max-weight in (0, 10]")
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = Bundle.open(args.bundle)
    data = load_split_dir(bundle.resolve_data_dir(args.data))
    if missing_serving_files(bundle.root):  # a bundle built before `recsvc build` wrote them
        print(f"tune prior: serving files written {write_serving_files(bundle.root, data)}")
    protocol, model_dir = validation_model(bundle, "the prior")
    ids = bundle.load_ids()
    ranker = ranker_of(bundle, model_dir, ids, args.dtype)  # the token or item-level target, loaded once
    trie = ranker.trie
    users = sample_users(data.eval_users("valid"), args.users, args.seed)
    excl = args.exclude_history
    train_prior = TransitionPrior.fit(data.train.values(), ids.item_ids.tolist(), fitted_on="train")
    print(f"tune prior: {len(users)} validation users, model {model_dir.name} (never saw the valid period), "
          f"metric {args.metric}{', history excluded' if excl else ''}")

    width = bundle.served_beam_width()  # the top-10 read from the served search, as a server reads it
    key = {"model": weights_fingerprint(model_dir), "data": str(bundle.resolve_data_dir(args.data)),
           "users": len(users), "seed": args.seed, "metric": args.metric, "exclude_history": excl,
           "dtype": str(ranker.dtype), "max_weight": args.max_weight, "beam_width": width}
    scorer, cache_info = None, None
    if widths is not None:  # each trial re-scores cached candidates: its own study (another objective)
        scorer, cache_info = rs.rescorer(bundle.root / "tune", "prior-excl" if excl else "prior", key, widths,
                                         ranker, trie, users, train_prior, excl, width)
        key = {**key, "objective": f"rescored: {cache_info['ranking']}", "candidates": asdict(widths)}
    # the unfused model (the first trial's settings), scored as the trials are
    base = (scorer.evaluate(PriorSettings(weight=0.0)) if scorer is not None else
            evaluate_rankings(ranker.lists(users, 10, width, excl), users, (10,)))
    print(f"without the prior: recall@10 {base['recall@10']:.4f} ndcg@10 {base['ndcg@10']:.4f}")

    def objective(trial) -> float:
        weight = trial.suggest_float("weight", 0.0, args.max_weight)  # drawn first, as the studies always did
        st = replace(suggest_transition(trial), weight=weight)
        start = time.perf_counter()
        if scorer is not None:
            m = scorer.evaluate(st)
        else:
            lists = rs.decode_lists(ranker, users, excl, width, train_prior.with_settings(st))
            m = evaluate_rankings(lists, users, (10,))
        trial.set_user_attr("seconds", time.perf_counter() - start)
        trial.set_user_attr("recall@10", m["recall@10"])
        trial.set_user_attr("ndcg@10", m["ndcg@10"])
        return m[args.metric]

    study = _study(bundle.root / "tune" / ("prior-excl.db" if excl else "prior.db"), "prior", args.seed, key)
    if not study.trials:  # the unfused model as the first trial: the search can only improve on it
        study.enqueue_trial({"weight": 0.0, "window": 1, "decay": 0.5, "beta": 1.0})
    t0 = time.monotonic()
    ran = _run(study, objective, args.trials, args.budget_minutes)
    best = study.best_trial
    chosen = PriorSettings(**best.params)
    # the chosen settings' full decode on validation: the check of the re-scored choice, and the fused lists the
    # headline figure compares with the prior's own ranking
    chosen_prior = train_prior.with_settings(chosen)
    start = time.perf_counter()
    decoded = rs.decode_lists(ranker, users, excl, width, chosen_prior)
    seconds = time.perf_counter() - start  # what one trial costs with --full-decode
    check = (rs.full_decode_check(decoded, scorer.lists(chosen), users, seconds, coverage(scorer, decoded))
             if scorer is not None else None)
    if check is not None:
        print(rs.format_check(check))
    headline = rs.target_over_prior(decoded, prior_rankings(chosen_prior, users, 10, excl), users, "tune prior",
                                    (bundle.excluded_prior_dir if excl else bundle.prior_dir).name)
    print(format_target_over_prior(headline))
    fit_on = resolve_fit_on("auto", protocol)
    out_dir = bundle.excluded_prior_dir if excl else bundle.prior_dir  # the service picks it by its exclusion
    TransitionPrior.fit(prior_sequences(data, fit_on), ids.item_ids.tolist(), chosen,
                        fitted_on=fit_on).save(out_dir)
    for stale in ("sequence", "sequence-train"):  # a mix tuned for the previous settings (`recsvc tune mix`)
        shutil.rmtree(out_dir / stale, ignore_errors=True)
    record = {"settings": best.params, "fit_on": fit_on, "valid_users": len(users), "metric": args.metric,
              "beam_width": width,
              "exclude_history": excl,
              "valid": {"recall@10": best.user_attrs["recall@10"], "ndcg@10": best.user_attrs["ndcg@10"]},
              "valid_without_prior": {"recall@10": base["recall@10"], "ndcg@10": base["ndcg@10"]},
              "trials": len(study.trials), "trials_this_run": ran,
              "seconds_this_run": round(time.monotonic() - t0, 1),
              "objective": "full decode" if scorer is None else "rescored",
              "seconds_per_trial": rs.per_trial(study, ran), "candidates": cache_info, "check": check,
              "target_over_prior": headline}
    meta = bundle.read()
    key = "prior_excl" if excl else "prior"
    bundle.update(**{key: {**best.params, "fit_on": fit_on}, f"target_over_{key}": headline},
                  tuning={**meta.get("tuning", {}), key: record})
    print_record(record)
    return 0


# ---------------------------------------------------------------------------------------------- target
def cmd_tune_target(args: argparse.Namespace) -> int:
    import torch

    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.presets import TARGET_PRESETS
    from training.ids.stage import stage_ids
    from training.target_lm.budget import default_patience
    from training.target_lm.settings import evaluator_factory
    from training.target_lm.train import TrainConfig, train_target

    _check_budget(args.trials, args.budget_minutes)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    bad = [p for p in presets if p not in TARGET_PRESETS]
    if not presets or bad:
        raise UserError(f"--presets: unknown {', '.join(bad) or '(none given)'}; expected {', '.join(TARGET_PRESETS)}")
    if not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    if not args.ids.is_file():
        raise UserError(f"semantic ids file not found: {args.ids}")
    if args.threads:
        torch.set_num_threads(args.threads)
    make_eval = evaluator_factory(argparse.Namespace(select_by="recall", recall_users=args.recall_users))
    patience = default_patience(None, fit_budget=True)  # the whole schedule runs, as `recsvc build --fit-budget`
    # what the trials' scores depend on besides the searched settings: a changed one starts a new study, whose
    # trials train in their own directory (a resumed trial continues its own checkpoints, never another study's)
    key = {"data": str(args.data.resolve()), "data_files": files_fingerprint(args.data, "*.txt"),
           "ids": files_fingerprint(args.ids.parent, args.ids.name), "epochs": args.epochs,
           "trial_minutes": args.trial_minutes, "presets": presets, "recall_users": args.recall_users,
           "seed": args.seed, "patience": patience}
    study = _study(args.out / "target.db", "target", args.seed, key)
    trials_dir = args.out / study.study_name

    def objective(trial) -> float:
        settings: dict[str, Any] = {
            "lr": trial.suggest_float("lr", 3e-4, 3e-3, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 1e-3, 0.3, log=True),
            "max_history": trial.suggest_categorical("max_history", [10, 20, 50]),
            "preset": trial.suggest_categorical("preset", presets),
        }
        out = trials_dir / f"trial-{trial.number}"
        bundle = Bundle.create(out, data=args.data)
        if not bundle.is_done("ids"):
            stage_ids(bundle, args.data, args.ids)
        cfg = TrainConfig(epochs=args.epochs, lr=settings["lr"], weight_decay=settings["weight_decay"],
                          max_minutes=args.trial_minutes, fit_budget=True, seed=args.seed,
                          patience=patience,
                          resume=(bundle.checkpoint_dir("target") / "last").is_dir())
        info = train_target(args.data, out, preset=settings["preset"], cfg=cfg, max_history=settings["max_history"],
                            make_evaluator=make_eval, prompt_header="compact", window_stride=5)
        trial.set_user_attr("best_epoch", info["best_epoch"])
        trial.set_user_attr("schedule_epochs", info["schedule_epochs"])
        trial.set_user_attr("seconds", info["seconds"])
        return float(info["best"]["value"])

    ran = _run(study, objective, args.trials, args.budget_minutes)
    best = study.best_trial
    record = {"settings": best.params, "valid_recall@10": best.value, "best_epoch": best.user_attrs.get("best_epoch"),
              "trials": len(study.trials), "trials_this_run": ran,
              "trial_dir": str(trials_dir / f"trial-{best.number}"), "study": study.study_name}
    (args.out / "best.json").write_text(json.dumps(record, indent=1) + "\n")
    print_record(record)
    return 0
