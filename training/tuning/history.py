"""``recsvc tune history``: choose on validation whether the service leaves a user's history items out of the list.

    recsvc tune history --bundle B [--users N] [--metric ndcg@10]

Whether people come back for what they already have depends on the catalog: groceries and consumables are
bought again, most of a beauty or a book catalog is not. A list that repeats the history spends places on items
the user will rarely take again; a list that never repeats it misses every re-purchase. So the choice is a
setting of the bundle, measured on validation like every other one, not a default of the code.

Protocol (no test data is read): the model that has not seen the valid period ranks the validation users twice,
as the service would (``training/tuning/validation_lists.py``): keeping the history items, with BUNDLE/prior, and
leaving them out, with BUNDLE/prior-excl when ``recsvc tune prior --exclude-history`` made one. The two top-10s
are scored user by user on the metric. History is excluded only when that wins by more than one standard error of
the paired difference; otherwise the lists keep it (the default, which loses no re-purchase). bundle.json gets
"exclude_history" (which ``recsvc serve`` and ``recsvc eval`` follow unless told otherwise) and the measurement
under "tuning"."history". Run it after the priors are tuned and before ``recsvc tune fresh``, which tunes the
fresh slots on the lists the bundle serves.
"""

from __future__ import annotations

import argparse
import time

from recsvc.errors import UserError
from recsvc_base.progress import print_record
from training.choices import TUNING_METRICS
from training.tuning.args import add_bundle_args, add_grid_args, add_run_args, open_inputs

METRICS = TUNING_METRICS


def register_history(sub) -> None:
    p = sub.add_parser("history", help="choose on validation whether served lists leave out the history items")
    add_bundle_args(p)
    add_grid_args(p, METRICS)
    add_run_args(p)
    p.set_defaults(func=cmd_tune_history)


def paired(with_exclusion: dict[int, list[int]], keeping: dict[int, list[int]], users, k: int) -> dict[str, float]:
    """Per-metric mean of each list kind and the mean and standard error of the per-user difference
    (excluding - keeping), over ``users`` (the same users, the same targets)."""
    from recsvc.data.metrics import ndcg_at_k, recall_at_k, standard_error

    out: dict[str, float] = {"users": float(len(users))}
    for name, fn in (("recall", recall_at_k), ("ndcg", ndcg_at_k)):
        kept = [fn(keeping.get(u.user_id, []), u.targets, k) for u in users]
        excl = [fn(with_exclusion.get(u.user_id, []), u.targets, k) for u in users]
        diff = [a - b for a, b in zip(excl, kept, strict=True)]
        n = max(len(users), 1)
        out[f"keep_{name}@{k}"] = sum(kept) / n
        out[f"exclude_{name}@{k}"] = sum(excl) / n
        out[f"{name}@{k}_diff"] = sum(diff) / n
        out[f"{name}@{k}_diff_se"] = standard_error(diff)
    return out


def decide(effect: dict[str, float], metric: str) -> bool:
    """Exclude history only when it wins on ``metric`` by more than one standard error of the paired difference.

    >>> decide({"ndcg@10_diff": 0.002, "ndcg@10_diff_se": 0.0005}, "ndcg@10")
    True
    >>> decide({"ndcg@10_diff": 0.0004, "ndcg@10_diff_se": 0.0005}, "ndcg@10")
    False
    """
    return effect[f"{metric}_diff"] > effect[f"{metric}_diff_se"]


def cmd_tune_history(args: argparse.Namespace) -> int:

    from recsvc.data.sampling import sample_users
    from training.tuning.validation_lists import ValidationLists

    if args.users is not None and args.users < 1:
        raise UserError("--users must be >= 1")
    bundle, _, data, ids = open_inputs(args)
    users = sample_users(data.eval_users("valid"), args.users, args.seed)
    lists = ValidationLists(bundle, data, ids, args.dtype, "the history exclusion")
    t0 = time.monotonic()
    print(f"tune history: {len(users)} validation users, model {lists.model_dir.name}, metric {args.metric}")
    keeping = lists.rank(users, False)
    excluding = lists.rank(users, True)
    effect = paired(excluding, keeping, users, 10)
    exclude = decide(effect, args.metric)
    repeats = 0  # valid targets that repeat one of the user's history items
    for u in users:
        seen = set(u.history)
        repeats += sum(t in seen for t in u.targets)
    record = {"exclude_history": exclude, "metric": args.metric, "rule": "exclude when the paired gain > 1 SE",
              "valid_users": len(users), "valid_targets_in_history": repeats,
              "valid_targets": sum(len(u.targets) for u in users),
              "prior_excl": bundle.prior_dir_for(True) != bundle.prior_dir_for(False),
              "valid": effect, "seconds": round(time.monotonic() - t0, 1)}
    meta = bundle.read()
    bundle.update(exclude_history=exclude, tuning={**meta.get("tuning", {}), "history": record})
    print_record(record)
    m = args.metric
    print(f"tune history: the bundle serves lists {'without' if exclude else 'with'} the history items "
          f"({m} {effect[f'keep_{m}']:.4f} keeping, {effect[f'exclude_{m}']:.4f} excluding, paired difference "
          f"{effect[f'{m}_diff']:+.4f} +- {effect[f'{m}_diff_se']:.4f})")
    return 0
