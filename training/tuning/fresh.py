"""``recsvc tune fresh``: choose the fresh-item slots (``recsvc.content.fresh``) on validation users, to BUNDLE/fresh.

    recsvc tune fresh --bundle B [--users N] [--metric ndcg@10]

Protocol (no test data is read):
- the model that has not seen the valid period ranks every sampled validation user once (the top 10 of a search
  at the served beam width, the bundle's tuned prior fused, refitted on the train period), as ``recsvc tune
  prior`` does, with the history items left out when the bundle serves so (``recsvc tune history``);
- the fresh items of validation are the catalog items nobody interacted with in the train period; their text
  embeddings (the packaged MiniLM sentence encoder, the one the semantic ids were made from) rank them per user,
  by similarity to the mean embedding of the history's last items or to a learned content query
  (``training/tuning/content_query.py``, fitted on the train period's interactions: no valid data);
- an Optuna grid over query x slots x window x min_similarity scores each merged list on the metric (slots 0 = the
  model alone is in the grid, so the search can only keep or improve it); a setting that lowers the warm slice's
  Recall@10 or NDCG@10 by one standard error of that figure or more is not chosen (new items must not cost the
  items the model already ranks well beyond the noise of the figure);
- BUNDLE/fresh gets the chosen settings, every catalog item's embedding, the fresh set of the served
  model's fitting period (deploy: train + valid) and, when the learned query is chosen, that query refitted on
  the served period (the train-period one stays beside it for evaluations on valid). bundle.json records the
  search under "tuning"."fresh".
"""

from __future__ import annotations

import argparse
import time

from recsvc.errors import UserError
from recsvc_base.progress import print_record
from training.choices import TUNING_METRICS
from training.tuning.args import add_bundle_args, add_grid_args, add_run_args, open_inputs

SLOTS = (0, 1, 2, 3, 4, 5, 6, 7)
WINDOWS = (1, 2, 3, 5, 10, 20)
MIN_SIMILARITIES = (-1.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
# --gate rate: the share of all users' fitting-period histories whose best fresh candidate may take a slot
RATES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0)
GATES = ("similarity", "rate")


def register_fresh(sub) -> None:
    p = sub.add_parser("fresh", help="choose the fresh-item slots on validation users (BUNDLE/fresh)")
    add_bundle_args(p)
    add_grid_args(p, TUNING_METRICS)
    add_run_args(p)
    p.add_argument("--embed-cache", default=None, help="embedding cache directory")
    p.add_argument("--queries", default="mean",
                   help="content queries in the grid: mean (default), learned, or mean,learned (see docs/QUALITY.md: "
                        "on Beauty validation chose the learned query and it did worse on test)")
    p.add_argument("--query-epochs", type=int, default=1, help="epochs of the learned query's fit")
    p.add_argument("--gate", choices=GATES, default="similarity",
                   help="what the grid searches to admit a fresh item: similarity (an absolute cosine threshold) or "
                        "rate (the share of all users' fitting-period histories whose best fresh candidate passes; "
                        "the threshold is resolved on each period's own fresh set: on valid's for the search, on "
                        "the served one for BUNDLE/fresh)")
    p.set_defaults(func=cmd_tune_fresh)


def cmd_tune_fresh(args: argparse.Namespace) -> int:
    import optuna

    from recsvc.content.fresh import QUERIES, FreshItems, FreshSettings, query_file
    from recsvc.data.metrics import score_lists
    from recsvc.data.sampling import sample_users
    from training.data.item_vectors import item_vectors
    from training.evaluation.fresh import (
        cold_items,
        fresh_candidates,
        fresh_candidates_by_user,
        fresh_lists,
        paired_effect,
    )
    from training.tuning.content_query import QueryFit, fit_or_reuse
    from training.tuning.prior_cli import resolve_fit_on
    from training.tuning.validation_lists import ValidationLists

    if args.users is not None and args.users < 1:
        raise UserError("--users must be >= 1")
    queries = [q.strip() for q in args.queries.split(",") if q.strip()]
    if not queries or any(q not in QUERIES for q in queries):
        raise UserError(f"--queries: expected a comma-separated subset of {', '.join(QUERIES)}")
    query_fit = QueryFit(epochs=args.query_epochs, seed=args.seed)  # checked before any work
    bundle, data_dir, data, ids = open_inputs(args)
    users = sample_users(data.eval_users("valid"), args.users, args.seed)
    # the lists the slots are added to are the served ones: without the history items when the bundle serves so
    # (`recsvc tune history`), with the prior tuned for that
    excl = bundle.serves_excluding_history()
    lists = ValidationLists(bundle, data, ids, args.dtype, "the fresh slots")
    prior = lists.priors(excl)
    t0 = time.monotonic()
    rankings = lists.rank(users, excl, 10, prior)
    vectors = item_vectors(data_dir, args.embed_cache)
    cold = cold_items(data, "train", ids.item_ids.tolist())  # the slice: targets without a train interaction
    fresh_now = fresh_candidates(data, "valid", "train", ids.item_ids.tolist())  # the catalog's fresh items then
    print(f"tune fresh: {len(users)} validation users, {len(fresh_now)} fresh items (in the catalog by the end of "
          f"valid, none in train), model "
          f"{lists.model_dir.name}{' + prior' if prior is not None else ''}, history "
          f"{'excluded' if excl else 'kept'}, metric {args.metric}")
    train_query = (fit_or_reuse(query_file(bundle.fresh_dir, "train"), data.sequences("train"), vectors, query_fit,
                                "train") if "learned" in queries else None)
    base = FreshItems(vectors, sorted(fresh_now), FreshSettings(), counted_on="train", query=train_query)
    # --gate rate: the population a rate is resolved on (every user's history of the fitting period)
    population = list(data.sequences("train").values()) if args.gate == "rate" else []
    thresholds: dict[tuple[str, int, float], float] = {}  # (query, window, rate) -> valid's threshold

    by_window: dict[tuple[str, int], dict] = {}  # (query, window) -> each user's max(SLOTS) best candidates

    def measure(settings: FreshSettings) -> dict:
        fresh = base.with_settings(settings)
        key = (settings.query, settings.window)
        if key not in by_window:
            by_window[key] = fresh_candidates_by_user(fresh, users, max(SLOTS), excl)
        at10 = fresh_lists(fresh, rankings, users, excl, by_window[key])(10)
        out = score_lists(lambda k: at10, users, (10,), cold)
        out["warm_effect"] = paired_effect(at10, rankings, users, 10, cold, False)
        return out

    def settings_of(params: dict) -> FreshSettings:
        """A trial's settings; under --gate rate, min_similarity resolved on valid's fresh set."""
        if args.gate == "similarity":
            return FreshSettings(**params)
        st = FreshSettings(query=params["query"], slots=params["slots"], window=params["window"])
        key = (st.query, st.window, params["rate"])
        if key not in thresholds:
            thresholds[key] = base.with_settings(st).rate_threshold(population, params["rate"])
        return FreshSettings(query=st.query, slots=st.slots, window=st.window, min_similarity=thresholds[key],
                             rate=params["rate"])

    def objective(trial) -> float:
        gate_name = "min_similarity" if args.gate == "similarity" else "rate"
        params = {"query": trial.suggest_categorical("query", queries),
                  "slots": trial.suggest_categorical("slots", SLOTS),
                  "window": trial.suggest_categorical("window", WINDOWS),
                  gate_name: trial.suggest_categorical(gate_name, MIN_SIMILARITIES if gate_name == "min_similarity"
                                                       else RATES)}
        st = settings_of(params)
        trial.set_user_attr("min_similarity", st.min_similarity)
        m = measure(st)
        for key in ("recall@10", "ndcg@10"):
            trial.set_user_attr(key, m[key])
            trial.set_user_attr(f"cold_{key}", m["cold"][key])
            trial.set_user_attr(f"warm_{key}", m["warm"][key])
            effect = m["warm_effect"]
            trial.set_user_attr(f"warm_{key}_diff", effect[f"{key}_diff"])
            trial.set_user_attr(f"warm_{key}_diff_se", effect[f"{key}_diff_se"])
            trial.set_user_attr(f"warm_{key}_se", effect[f"{key}_se"])
        return m[args.metric]

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    gates = ({"min_similarity": list(MIN_SIMILARITIES)} if args.gate == "similarity" else {"rate": list(RATES)})
    grid = {"query": queries, "slots": list(SLOTS), "window": list(WINDOWS), **gates}
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.GridSampler(grid, seed=args.seed))
    study.optimize(objective, n_trials=len(queries) * len(SLOTS) * len(WINDOWS) * len(next(iter(gates.values()))))
    # the warm slice must not drop beyond noise: a setting is kept only when the warm slice's Recall@10 and NDCG@10
    # lose less than one standard error of that figure (the noise of the number a reader compares; slots 0, a
    # change of 0, always passes); ties: the first in grid order
    feasible = [t for t in study.trials if all(
        t.user_attrs[f"warm_{key}_diff"] > -t.user_attrs[f"warm_{key}_se"] for key in ("recall@10", "ndcg@10"))]
    best = max(feasible, key=lambda t: (t.value, -t.number))
    chosen = settings_of(best.params)
    off = measure(FreshSettings())
    fit_on = resolve_fit_on("auto", lists.protocol)
    served = cold_items(data, fit_on, ids.item_ids.tolist())
    served_query = None
    if chosen.query == "learned":  # refitted on the served model's period (deploy: train + valid)
        served_query = (train_query if fit_on == "train" else fit_or_reuse(
            query_file(bundle.fresh_dir, fit_on), data.sequences(fit_on), vectors, query_fit, fit_on))
    served_fresh = FreshItems(vectors, sorted(served), chosen, counted_on=fit_on, query=served_query)
    if chosen.rate is not None:  # the rate resolved on the served fresh set, over the served period's histories
        served_fresh = served_fresh.resolve_rate(list(data.sequences(fit_on).values()), chosen.rate)
    served_fresh.save(bundle.fresh_dir)
    record = {"settings": best.params, "gate": args.gate, "valid_min_similarity": chosen.min_similarity,
              "served_min_similarity": served_fresh.settings.min_similarity,
              "metric": args.metric, "exclude_history": excl, "valid_users": len(users),
              "valid_fresh_items": len(fresh_now),
              "valid_cold_items": len(cold), "served_fresh_items": len(served), "counted_on": fit_on,
              "valid": {k: v for k, v in best.user_attrs.items()},
              "valid_without_fresh": {"recall@10": off["recall@10"], "ndcg@10": off["ndcg@10"],
                                      "cold_recall@10": off["cold"]["recall@10"],
                                      "warm_recall@10": off["warm"]["recall@10"],
                                      "warm_ndcg@10": off["warm"]["ndcg@10"]},
              "trials": len(study.trials), "feasible_trials": len(feasible),
              "query_fit": {"train": train_query.fit if train_query is not None else None,
                            "served": served_query.fit if served_query is not None else None},
              "best_by_query": {q: max((t.value for t in feasible if t.params["query"] == q), default=None)
                                for q in queries},
              "seconds": round(time.monotonic() - t0, 1)}
    meta = bundle.read()
    served_settings = best.params if chosen.rate is None else {
        **best.params, "min_similarity": served_fresh.settings.min_similarity}
    bundle.update(fresh={**served_settings, "counted_on": fit_on}, tuning={**meta.get("tuning", {}), "fresh": record})
    print_record(record)
    return 0
