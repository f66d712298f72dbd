"""``recsvc tune fresh-signals``: do signals beyond text similarity rank fresh items better, on valid AND on test?

    recsvc tune fresh-signals --bundle B [--top 5] [--json F]

The fresh-item slots (``recsvc.content.fresh``) rank a period's fresh items for a user by the cosine similarity of
their text embedding to the mean embedding of the user's last ``window`` history items (the bundle's tuned
window). Two further signals are candidates for that ranking:
- **content popularity**: how much of the fitting period's recent demand lies near the item in text space, a
  kernel density over every fitting-period user's last item: log sum_u exp((cos(item, last_u) - 1) / tau),
  standardised over the fresh items; it ranks a new product by what people have been buying lately;
- **the target's first code**: the target's log-probability (full-vocabulary log-softmax, the beam-score
  convention) of the item's first semantic-id code after the user's prompt: the generative model's view of
  which region of the catalog the user goes to next, which a fresh item shares with the warm items of its
  code prefix.
Score = similarity + mu * popularity + lambda * first-code log-prob. For each (mu, lambda) of a small grid the
command measures, among the users with a cold target, the share of their cold targets in the top ``--top``
fresh items. mu and lambda are chosen on valid (the train-only target, the fresh items of valid); the test
figure (the served target, the served period's fresh items) is reported at valid's choice and at no extra
signal, so a reader sees whether the choice carries over. Nothing is written to the bundle: this is an analysis
that decides whether a signal deserves a place in ``recsvc tune fresh``'s grid.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from recsvc.bundle.loading import PRECISIONS
from recsvc.errors import UserError
from training.tuning.args import add_bundle_args, open_inputs

MUS = (0.0, 0.01, 0.03, 0.1, 0.3)
LAMBDAS = (0.0, 0.01, 0.1, 1.0)
TAU = 0.02


def register_fresh_signals(sub) -> None:
    p = sub.add_parser("fresh-signals", help="analysis: content popularity and the target's first code as extra "
                                             "fresh-item signals, chosen on valid, checked on test")
    add_bundle_args(p)
    p.add_argument("--top", type=int, default=5, help="fresh candidates counted per user")
    p.add_argument("--window", type=int, default=None, help="history items in the query (default: the bundle's)")
    p.add_argument("--dtype", choices=PRECISIONS, default="fp32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--embed-cache", default=None, help="embedding cache directory")
    p.add_argument("--json", dest="json_path", type=Path, default=None)
    p.set_defaults(func=cmd_fresh_signals)


def popularity(fresh_vectors: np.ndarray, recent_vectors: np.ndarray, tau: float = TAU) -> np.ndarray:
    """Standardised log kernel density of ``recent_vectors`` [n, d] at each fresh item [f, d] (unit rows) -> [f].

    >>> v = np.eye(3, dtype=np.float32)
    >>> p = popularity(v[:2], np.stack([v[0], v[0], v[1]]))
    >>> bool(p[0] > p[1])
    True
    """
    sims = fresh_vectors @ recent_vectors.T  # [f, n]
    top = sims.max(axis=1, keepdims=True)
    dens = np.log(np.exp((sims - top) / tau).sum(axis=1)) + (top[:, 0] - 1.0) / tau  # stable log-sum-exp
    return (dens - dens.mean()) / max(float(dens.std()), 1e-12)


def share_in_top(scores: np.ndarray, fresh_ids: np.ndarray, history: set[int], cold_targets: set[int],
                 top: int) -> float:
    """Share of ``cold_targets`` among the ``top`` best-scored fresh items outside the history.

    >>> share_in_top(np.array([0.1, 0.9, 0.5]), np.array([7, 8, 9]), {8}, {7, 9}, 1)
    0.5
    """
    picked: list[int] = []
    for r in np.argsort(-scores, kind="stable"):
        if int(fresh_ids[r]) not in history:
            picked.append(int(fresh_ids[r]))
            if len(picked) == top:
                break
    return len(set(picked) & cold_targets) / len(cold_targets)


def cmd_fresh_signals(args: argparse.Namespace) -> int:
    import torch

    from recsvc.bundle.loading import load_causal_lm
    from recsvc.content.fresh import FreshItems, FreshSettings
    from training.data.item_vectors import item_vectors
    from training.evaluation.fresh import cold_items, fresh_candidates
    from training.tuning.prior_cli import resolve_fit_on
    from training.tuning.studies import validation_model

    if args.top < 1:
        raise UserError("--top must be >= 1")
    bundle, data_dir, data, ids = open_inputs(args)
    builder = bundle.prompt_builder(ids=ids)
    catalog = ids.item_ids.tolist()
    stored = FreshItems.load(bundle.fresh_dir).settings if (bundle.fresh_dir / "fresh.json").is_file() else None
    window = args.window if args.window is not None else (stored.window if stored is not None else 2)
    threshold = stored.min_similarity if stored is not None else 0.0
    if window < 1:
        raise UserError("--window must be >= 1")
    vectors = item_vectors(data_dir, args.embed_cache)
    protocol, valid_model = validation_model(bundle, "the fresh-item signals")
    t0 = time.monotonic()
    periods = {"valid": ("train", valid_model), "test": (resolve_fit_on("auto", protocol), bundle.target_dir)}
    shares: dict[str, dict[tuple[float, float], float]] = {}
    demand: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for split, (fit_on, model_dir) in periods.items():
        ranker = FreshItems(vectors, fresh_candidates(data, split, fit_on, catalog), FreshSettings(window=window))
        fresh = ranker.fresh_ids  # [f] ascending
        cold = cold_items(data, fit_on, catalog)
        users = [u for u in data.eval_users(split) if any(t in cold for t in u.targets)]
        fv = vectors.vectors[vectors.rows(fresh.tolist())]  # [f, d]
        last = [seq[-1] for seq in data.sequences(fit_on).values() if seq]
        rows = vectors.rows(last)
        pop = popularity(fv, vectors.vectors[rows[rows >= 0]])  # [f]
        model = load_causal_lm(model_dir, dtype=args.dtype)
        first = np.array([builder.item_token_ids(int(i))[0] for i in fresh])  # [f] first-code token ids
        per_user = []
        for u in users:
            sim = ranker.similarities(u.history)  # [f] the served mean query's
            if sim is None:
                continue
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([builder.prompt_ids(u.history)])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1).numpy()[first]  # [f]
            per_user.append((sim, lp, set(u.history), {t for t in u.targets if t in cold}))
        # the period's demand for fresh items, over ALL its users: how often the best fresh candidate (similarity
        # alone) is a target, and how often it passes the bundle's threshold (a slot is given)
        all_users = data.eval_users(split)
        best_hit = passing = 0
        for u in all_users:
            best = ranker.candidates([u.history], 1)[0]  # the best fresh item outside the history
            if best:
                best_hit += best[0][0] in set(u.targets)
                passing += best[0][1] >= threshold
        demand[split] = {"users": len(all_users), "share_with_a_cold_target": len(users) / max(len(all_users), 1),
                         "best_candidate_hit_rate": best_hit / max(len(all_users), 1),
                         "share_given_a_slot": passing / max(len(all_users), 1), "threshold": threshold}
        shares[split] = {(mu, lam): float(np.mean([share_in_top(s + mu * pop + lam * lp, fresh, h, c, args.top)
                                                   for s, lp, h, c in per_user]))
                         for mu in MUS for lam in LAMBDAS}
        counts[split] = {"users_with_a_cold_target": len(per_user), "fresh_items": len(fresh)}

    def on_valid(keys) -> tuple[float, float]:  # valid's best (ties: the smaller weights, listed first)
        return max(keys, key=lambda key: shares["valid"][key])

    pick = {"similarity alone": (0.0, 0.0),
            "+ popularity (valid's best mu)": on_valid([(m, 0.0) for m in MUS]),
            "+ first code (valid's best lambda)": on_valid([(0.0, lam) for lam in LAMBDAS]),
            "both (valid's best pair)": on_valid(list(shares["valid"]))}
    print(f"share of cold targets in the top {args.top} fresh items (users with a cold target; window {window})")
    print("| ranking | mu | lambda | valid | test |")
    print("| --- | --- | --- | --- | --- |")
    for name, (mu, lam) in pick.items():
        print(f"| {name} | {mu} | {lam} | {shares['valid'][(mu, lam)]:.4f} | {shares['test'][(mu, lam)]:.4f} |")
    for split, d in demand.items():
        print(f"{split}: {d['share_with_a_cold_target']:.3f} of {d['users']} users have a cold target; the best "
              f"fresh candidate is a target for {d['best_candidate_hit_rate']:.4f} of them and passes the "
              f"threshold {d['threshold']:.2f} for {d['share_given_a_slot']:.3f}")
    record = {"top": args.top, "window": window, "tau": TAU, "counts": counts, "demand": demand,
              "chosen": {name: {"mu": k[0], "lambda": k[1], "valid": shares["valid"][k], "test": shares["test"][k]}
                         for name, k in pick.items()},
              "grid": {split: [{"mu": k[0], "lambda": k[1], "share": v} for k, v in table.items()]
                       for split, table in shares.items()},
              "seconds": round(time.monotonic() - t0, 1)}
    if args.json_path is not None:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(record, indent=1))
    return 0
