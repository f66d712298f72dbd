"""``recsvc tune dense``: how the target's dense head's nearest items are ranked with the beams, chosen on
validation (``recsvc.content.dense_head``: score = beam score, or the last beam's - floor, + blend * cosine).

The train-only target (BUNDLE/target-train for a deploy bundle) ranks every validation user once at the served
width, with the bundle's prior refitted on the train period and its history rule; the head's cosines are kept.
A grid of (blend, floor) is scored on ``--users`` sampled tuning users (NDCG@10; blend 0 is the beams alone),
the choice is reported on every validation user and on the users the grid never saw (paired against the beams
alone, with the cold and warm slices), and written to the dense_head.json of the bundle's targets.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from recsvc.bundle.loading import PRECISIONS
from recsvc.errors import UserError


def register_dense(sub) -> None:
    p = sub.add_parser("dense", help="choose how the target's dense head is ranked with the beams (validation)")
    p.add_argument("--bundle", type=Path, required=True, help="bundle whose target has a dense head")
    p.add_argument("--data", type=Path, default=None, help="split data directory (default: the bundle's)")
    p.add_argument("--users", type=int, default=None,
                   help="validation users the grid is scored on (a seeded sample; default: every validation user, "
                        "as the cold slice is small: about one user in nine)")
    p.add_argument("--blends", default="0,0.5,1,2,4,8,16,32,64",
                   help="comma-separated cosine weights (0: beams alone)")
    p.add_argument("--floors", default="0,1,2,4", help="comma-separated starts of non-beam items below the last beam")
    p.add_argument("--candidates", type=int, default=20, help="the head's nearest items added per request")
    p.add_argument("--pools", default="all,fresh",
                   help="comma-separated pools the head adds from: all (every catalog item), fresh (only the items "
                        "its target was not trained on: LIGER's cold-start candidates)")
    p.add_argument("--calibrations", default="none,pool",
                   help="comma-separated: none, pool (fresh items' cosines matched to the known items' per query)")
    p.add_argument("--exclude-history", action="store_true", default=None,
                   help="leave history items out (default: the bundle's choice, bundle.json 'exclude_history')")
    p.add_argument("--rule", choices=("ndcg", "cold-guard"), default="ndcg",
                   help="ndcg: the best NDCG@10; cold-guard: the most cold-slice Recall@10 among the settings whose "
                        "NDCG@10 is within one paired standard error of the best")
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="report only; leave the bundle's settings as they are")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    p.set_defaults(func=cmd_tune_dense)


def _floats(text: str, name: str) -> list[float]:
    try:
        values = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--{name} must be comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise UserError(f"--{name} needs numbers >= 0, got {text!r}")
    return values


@torch.inference_mode()
def beams_and_similarities(model, builder, trie, users, width: int, retriever, exclude_history: bool, prior: Any,
                           batch_size: int = 64) -> dict[int, tuple[list[int], list[float], torch.Tensor]]:
    """user id -> (the beams' items best first, their scores, the head's cosine to every catalog item [n] fp16)."""
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.scoring.prior import prior_log_mass
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc_base.progress import progress_bar

    engine = BeamSearch(model, trie, builder.code_offset)
    fuse = prior is not None and prior.settings.weight > 0
    order = sorted(users, key=lambda u: min(len(u.history), builder.max_history))
    out: dict[int, tuple[list[int], list[float], torch.Tensor]] = {}
    for start in progress_bar(range(0, len(order), batch_size), desc="beams + dense", unit="batch", leave=False):
        chunk = order[start:start + batch_size]
        prompt_ids = [builder.prompt_ids(u.history) for u in chunk]
        excluded = [u.history for u in chunk] if exclude_history else None
        dead = trie.dead_nodes(excluded) if excluded else None
        fused = (prior_log_mass(trie, torch.from_numpy(prior.probs([u.history for u in chunk])),
                                prior.settings.weight) if fuse else None)
        res = decode(engine, None, PromptBatch.from_lists(prompt_ids), [u.history for u in chunk], "plain", width,
                     (0, 0), dead=dead, prior=fused)
        assert res.prompt_hidden is not None  # plain decoding returns its prefill's hidden states [B, H]
        sims = retriever.similarities(res.prompt_hidden).half()  # the query as served
        for r, u in enumerate(chunk):
            ok = res.leaves[r] >= 0
            items = trie.leaf_items(res.leaves[r][ok], excluded[r] if excluded else ())
            out[u.user_id] = (items, res.scores[r][ok].float().tolist(), sims[r])
    return out


def merged_lists(cache, users, retriever, ids, k: int, exclude_history: bool) -> dict[int, list[int]]:
    out = {}
    for u in users:
        items, scores, sims = cache[u.user_id]
        out[u.user_id] = retriever.merge(items, scores, sims, ids, k, u.history if exclude_history else ())[0]
    return out


def cmd_tune_dense(args: argparse.Namespace) -> int:
    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.loading import load_causal_lm
    from recsvc.content.dense_head import CALIBRATIONS, DenseRetriever, has_dense_head, write_settings
    from recsvc.data.metrics import evaluate_rankings, evaluate_slices
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from tokenizer_rqvae.trie import CatalogTrie
    from training.evaluation.fresh import cold_items, prefix_sharing
    from training.evaluation.lead import paired_lead, per_user
    from training.evaluation.ranking import period_catalog_rows, serving_model
    from training.tuning.studies import validation_model
    from training.tuning.validation_lists import train_period_prior

    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if (args.users is not None and args.users < 1) or args.candidates < 1:
        raise UserError("--users and --candidates must be >= 1")
    blends, floors = _floats(args.blends, "blends"), _floats(args.floors, "floors")
    pools = [x.strip() for x in args.pools.split(",") if x.strip()]
    if not pools or set(pools) - {"all", "fresh"}:
        raise UserError(f"--pools takes all and/or fresh, got {args.pools!r}")
    calibrations = [x.strip() for x in args.calibrations.split(",") if x.strip()]
    if not calibrations or set(calibrations) - set(CALIBRATIONS):
        raise UserError(f"--calibrations takes {' and/or '.join(CALIBRATIONS)}, got {args.calibrations!r}")
    bundle = Bundle.open(args.bundle)
    _, model_dir = validation_model(bundle, "the dense head's merge")
    if not has_dense_head(model_dir):
        raise UserError(f"{model_dir} has no dense head: build the target with --dense-head WEIGHT")
    data = load_split_dir(bundle.resolve_data_dir(args.data))
    ids = bundle.load_ids()
    exclude = bool(bundle.read().get("exclude_history", False)) if args.exclude_history is None else True
    retriever = DenseRetriever.load(model_dir, ids).with_settings(candidates=args.candidates)
    retriever = retriever.within(period_catalog_rows(data, "valid", ids))  # the catalog of the valid period
    model = serving_model(load_causal_lm(model_dir, dtype=args.dtype))
    builder = bundle.prompt_builder(ids=ids)
    prior = train_period_prior(bundle, data, ids, exclude)
    users = data.eval_users("valid")
    tuning = sample_users(users, args.users, args.seed) if args.users is not None else list(users)
    tuning_ids = {u.user_id for u in tuning}
    held_out = [u for u in users if u.user_id not in tuning_ids]
    width = max(10, bundle.served_beam_width() or 20)
    cold = cold_items(data, "train", ids.item_ids.tolist())
    cache = beams_and_similarities(model, builder, CatalogTrie(ids), users, width, retriever, exclude, prior)

    if retriever.known is None:
        pools, calibrations = ["all"], ["none"]  # a head saved without its target's items
    grid: list[dict[str, Any]] = []
    per_trial = []
    trials = [(pool, calibrate, blend, floor) for pool in pools for calibrate in calibrations for blend in blends
              for floor in (floors if blend > 0 else [0.0])
              if blend > 0 or (pool, calibrate) == (pools[0], calibrations[0])]  # the beams alone: one trial
    for pool, calibrate, blend, floor in trials:
        trial = retriever.with_settings(blend=blend, floor=floor, pool=pool, calibrate=calibrate)
        lists = merged_lists(cache, tuning, trial, ids, 10, exclude)
        grid.append({"pool": pool, "calibrate": calibrate, "blend": blend, "floor": floor,
                     **evaluate_rankings(lists, tuning, (10,)),
                     "cold": evaluate_slices(lists, tuning, (10,), cold)["cold"]})
        per_trial.append(per_user(lists, tuning, 10, "ndcg"))
    best = max(grid, key=lambda g: (g["ndcg@10"], -g["blend"]))  # ties: the smaller blend
    if args.rule == "cold-guard":  # the most cold recall among the settings within one paired SE of the best NDCG
        top = per_trial[grid.index(best)]
        for g, scores in zip(grid, per_trial, strict=True):
            lead = paired_lead(scores, top, resamples=0)
            g["ndcg_gap_se"] = lead["diff"] / lead["diff_se"] if lead["diff_se"] else 0.0
        best = max((g for g in grid if g["ndcg_gap_se"] >= -1.0),
                   key=lambda g: (g["cold"].get("recall@10", 0.0), g["ndcg@10"], -g["blend"]))
    chosen = retriever.with_settings(blend=best["blend"], floor=best["floor"], pool=best["pool"],
                                     calibrate=best["calibrate"])
    plain = retriever.with_settings(blend=0.0)
    report: dict[str, Any] = {"bundle": str(bundle.root), "model": str(model_dir), "exclude_history": exclude,
                              "prior": prior is not None, "width": width, "tuning_users": len(tuning),
                              "grid": grid, "chosen": {"blend": chosen.settings.blend, "floor": chosen.settings.floor,
                                                       "candidates": chosen.settings.candidates,
                                                       "pool": chosen.settings.pool,
                                                       "calibrate": chosen.settings.calibrate},
                              "rule": args.rule,
                              # how many cold items sit on code paths the target saw continue (the beams' reach)
                              "cold_prefix_shared": prefix_sharing(ids, cold, set(ids.item_ids.tolist()) - cold)}
    for name, part in (("all", users), ("held_out", held_out)):
        if not part:
            continue
        merged = merged_lists(cache, part, chosen, ids, 20, exclude)
        beams = merged_lists(cache, part, plain, ids, 20, exclude)
        entry: dict[str, Any] = {"users": len(part)}
        for label, lists in (("merged", merged), ("beams", beams)):
            entry[label] = {**evaluate_rankings(lists, part, (10, 20)),
                            **evaluate_slices(lists, part, (10, 20), cold)}
        entry["paired"] = {f"{m}@{k}": paired_lead(per_user(merged, part, k, m), per_user(beams, part, k, m))
                           for m in ("recall", "ndcg") for k in (10, 20)}
        report[name] = entry
    if not args.no_write:
        settings = {**asdict(chosen.settings), "tuned": {k: v for k, v in report.items() if k != "grid"}}
        settings["tuned"]["grid"] = [{k: v for k, v in g.items()} for g in grid]
        for directory in {model_dir, bundle.target_dir}:
            if has_dense_head(directory):
                write_settings(directory, type(chosen.settings)(**settings))
    text = json.dumps(report, indent=1, default=float)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    a = report["all"]
    c = chosen.settings
    print(f"dense: pool {c.pool}, calibrate {c.calibrate}, blend {c.blend:g}, floor {c.floor:g} "
          f"(tuning NDCG@10 "
          f"{best['ndcg@10']:.4f}); all {len(users)} validation users: Recall@10 {a['merged']['recall@10']:.4f} "
          f"vs beams {a['beams']['recall@10']:.4f}, NDCG@10 {a['merged']['ndcg@10']:.4f} vs "
          f"{a['beams']['ndcg@10']:.4f}; cold Recall@10 {a['merged']['cold'].get('recall@10', 0):.4f}, "
          f"warm {a['merged']['warm'].get('recall@10', 0):.4f} vs {a['beams']['warm'].get('recall@10', 0):.4f}")
    shared = ", ".join(f"{n} codes {v:.3f}" for n, v in report["cold_prefix_shared"].items())
    print(f"cold items whose id prefix some trained item's id begins with: {shared}")
    return 0
