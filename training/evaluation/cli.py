"""`recsvc eval --bundle B --split valid|test --k 1,5,10,20 --json FILE`: Recall@K / NDCG@K beside baselines.

Baselines (training/baselines) are fitted under a protocol and scored on the same users with the same metric
code and history exclusion: ``--baselines popularity,transition,transition-window,sasrec`` (default: the first
three; sasrec costs minutes), ``--protocol paper|deploy`` (default: the bundle's), ``--baselines-only --data D``
(no bundle needed).

Sharded: ``torchrun --nproc_per_node N -m recsvc.cli.main eval ...`` (or ``accelerate launch``; WORLD_SIZE > 1)
splits the users' batches across the processes (gloo on CPU), gathers the rankings to rank 0, which alone
scores them, runs the baselines, prints and writes the JSON (``"processes": N``): the same figures as one process.

Paired comparisons: every method against the served lists user by user on every user and on the cold / warm
slices (``"paired"``), the figures read first (``"headline"``), each user's scores (``"per_user"``);
``--against B`` / ``--against-variant no-prior|no-dense|no-slots`` adds a second bundle (or the same one with a part
left out) ranked on the same users under the same rules (``"against"``, training/evaluation/compare.py).
``recsvc eval summarize s0.json s1.json s2.json [--json out]``: the mean over runs (e.g. training seeds) of each
ratio, with a joint bootstrap interval over the users (training/evaluation/seeds.py).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from recsvc.bundle.loading import PRECISIONS
from recsvc.data.split import EVAL_SPLITS
from recsvc.errors import UserError
from recsvc.service.arg_types import add_history_flags
from training.baselines import BASELINES, DEFAULT_BASELINES, PROTOCOLS, parse_baselines
from training.choices import REFIT_MODES
from training.evaluation.baselines import format_table as baselines_table
from training.evaluation.bundle_ranking import VARIANTS
from training.evaluation.lead import format_leads


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--k takes comma-separated integers, got {text!r}") from None
    if not ks or ks[0] < 1 or ks[-1] > 100:
        raise UserError(f"--k values must lie in 1..100, got {text!r}")
    return ks


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="offline Recall@K / NDCG@K of a bundle's target vs baselines")
    p.add_argument("--bundle", help="bundle directory (optional with --baselines-only)")
    p.add_argument("--split", choices=EVAL_SPLITS, default="test")
    p.add_argument("--k", default="1,5,10,20",
                   help="cutoffs, comma-separated (beams searched: the bundle's served width, bundle.json "
                        "'beam_width' else 20, or the largest cutoff when larger; every cutoff is read from that "
                        "one search, as the service reads its top-k)")
    p.add_argument("--data", help="data directory (default: the one recorded in the bundle)")
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-users", type=int, help="evaluate a fixed random sample of users")
    add_history_flags(p, "no method recommends a user's history items (default: as the bundle is served, "
                         "bundle.json 'exclude_history' chosen on validation by `recsvc tune history`; without a "
                         "bundle: keep them)",
                      "every method may recommend history items (overrides the bundle's choice)")
    p.add_argument("--no-prior", action="store_true", help="do not fuse the bundle's transition prior (BUNDLE/prior)")
    p.add_argument("--no-dense", action="store_true",
                   help="rank with the beams alone, without the target's dense head (when it has one)")
    p.add_argument("--no-fresh", action="store_true",
                   help="do not give fresh items (BUNDLE/fresh, `recsvc tune fresh`) the tails of the lists")
    p.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                   help=f"comma-separated subset of {','.join(BASELINES)}, or none (default: %(default)s)")
    p.add_argument("--protocol", choices=PROTOCOLS,
                   help="paper: the model and baselines learned from the train period only (a deploy bundle's "
                        "BUNDLE/target-train and a train-only prior); deploy: from train + valid for the test "
                        "split (default: the bundle's recorded protocol, else paper)")
    p.add_argument("--baselines-only", action="store_true",
                   help="evaluate the baselines without a bundle's target (needs --data)")
    p.add_argument("--cache-dir", help="fitted SASRec weights are kept and reused here "
                                       "(default: BUNDLE/baselines, or artifacts/baselines without a bundle)")
    p.add_argument("--sasrec-max-minutes", type=float, default=10.0,
                   help="wall-clock budget of each SASRec training run (default: %(default)s)")
    p.add_argument("--sasrec-refit", choices=REFIT_MODES, default="scratch",
                   help="deploy protocol: retrain SASRec on train + valid from scratch for the epoch count chosen "
                        "on valid (default), or continue the valid-selected model for one epoch at half lr "
                        "(as the target's refit: faster, weaker)")
    p.add_argument("--against", metavar="BUNDLE",
                   help="a second bundle ranked on the same users with the same history rule, protocol and data: "
                        "A / B per metric and cutoff with 95%% paired intervals, on every user and the cold / warm "
                        "slices (default with --against-variant: this bundle)")
    p.add_argument("--against-variant", choices=VARIANTS,
                   help="B without its prior, dense head or fresh slots (B: --against, else this bundle)")
    p.add_argument("--against-label", help="B's name in the table and JSON (default: its directory and variant)")
    p.add_argument("--json", dest="json_path", help="write the metrics here")
    p.set_defaults(func=cmd_eval)
    sub = p.add_subparsers(dest="eval_action", metavar="summarize")
    from training.evaluation.seeds import register as register_summarize

    register_summarize(sub)


def format_table(result: dict) -> str:
    lines = ["| metric | model | popularity |", "| --- | --- | --- |"]
    for k in result["ks"]:
        for m in ("recall", "ndcg"):
            key = f"{m}@{k}"
            lines.append(f"| {key} | {result['model'][key]:.4f} | {result['popularity'][key]:.4f} |")
    return "\n".join(lines)


def cmd_eval(args: argparse.Namespace) -> int:
    names = parse_baselines(args.baselines)
    ks = parse_ks(args.k)
    if args.sasrec_max_minutes <= 0:
        raise UserError("--sasrec-max-minutes must be > 0")
    if args.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    if args.max_users is not None and args.max_users < 1:
        raise UserError("--max-users must be >= 1")
    if not args.baselines_only and not args.bundle:
        raise UserError("--bundle is required (or --baselines-only with --data)")
    if args.baselines_only and (args.against or args.against_variant):
        raise UserError("--against and --against-variant compare two bundles' lists: not with --baselines-only")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _sharded(args, names, ks)
    return _eval(args, names, ks)


def _sharded(args: argparse.Namespace, names: tuple[str, ...], ks: list[int]) -> int:
    """Under torchrun / accelerate launch: one process group (gloo on CPU) around the evaluation."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    try:
        if args.baselines_only:  # no model to shard: rank 0 alone
            return _baselines_only(args, names, ks) if state.is_main_process else 0
        return _eval(args, names, ks)
    finally:  # the worker then leaves through recsvc.cli.worker_exit
        if dist.is_initialized():
            dist.destroy_process_group()


def _eval(args: argparse.Namespace, names: tuple[str, ...], ks: list[int]) -> int:
    if args.baselines_only:
        return _baselines_only(args, names, ks)
    from recsvc.bundle.directory import Bundle
    from training.evaluation.compare import Against, format_against
    from training.evaluation.evaluate import evaluate_bundle
    from training.evaluation.headline import format_headline

    against = Against.from_args(args.bundle, args.against, args.against_variant, args.against_label)
    bundle = Bundle.open(args.bundle)
    bundle_protocol = bundle.read().get("protocol", "paper")
    protocol = args.protocol or bundle_protocol
    # every method under the same exclusion: the one asked for, else the one the bundle is served with
    exclude = bundle.excludes_history(args.exclude_history)
    result = evaluate_bundle(args.bundle, args.split, ks, args.data, args.dtype, args.batch_size,
                             args.max_users, exclude, use_prior=not args.no_prior,
                             use_fresh=not args.no_fresh, use_dense=not args.no_dense,
                             baselines=names, protocol=protocol, against=against,
                             baseline_options=_baseline_options(args, Path(args.bundle) / "baselines"))
    if result is None:  # a sharded run's other ranks: rank 0 reports
        return 0
    result["model_fit_on"] = "train" if protocol == "paper" else "train+valid"
    result["bundle_protocol"] = bundle_protocol
    print(f"{args.split}: {result['users']} users, {result['ms_per_user']} ms/user ({result['dtype']}), "
          f"protocol {protocol}, history items {'excluded' if exclude else 'kept'} for every method"
          f"{' (the bundle is served so)' if args.exclude_history is None else ''}")
    print(baselines_table(result) if result.get("baselines") else format_table(result))
    if result.get("lead"):
        print(format_leads(result, ks))
    print(format_headline(result["headline"]))
    if result.get("against"):
        print(format_against(result))
    if args.json_path:
        # the model's figures flat (as before) and whole under "model" (with its cold / warm slices)
        from recsvc.hardware import machine

        flat = {"machine": machine(), **{k: v for k, v in result.items() if k not in ("model", "popularity")},
                **{k: v for k, v in result["model"].items() if not isinstance(v, dict)}, "model": result["model"],
                **{f"popularity_{k}": v for k, v in result["popularity"].items()}}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(flat, indent=1))
    return 0


def _baseline_options(args: argparse.Namespace, default_cache: Path) -> dict:
    from training.baselines.sasrec_train import SASRecSettings

    return {"sasrec_settings": SASRecSettings(max_minutes=args.sasrec_max_minutes, refit=args.sasrec_refit),
            "cache_dir": Path(args.cache_dir) if args.cache_dir else default_cache}


def _baselines_only(args: argparse.Namespace, names: tuple[str, ...], ks: list[int]) -> int:
    """``--baselines-only``: no target is loaded; the data comes from --data (or the bundle's record)."""
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from training.baselines.base import fit_period
    from training.evaluation.baselines import evaluate_baselines
    from training.evaluation.fresh import cold_items

    if not names:
        raise UserError("--baselines-only needs at least one baseline (--baselines)")
    protocol, exclude = args.protocol, bool(args.exclude_history)
    if args.bundle:
        from recsvc.bundle.directory import Bundle

        bundle = Bundle.open(args.bundle)
        exclude = bundle.excludes_history(args.exclude_history)
        data_dir = bundle.resolve_data_dir(args.data)
        protocol = protocol or bundle.read().get("protocol", "paper")
        default_cache = bundle.root / "baselines"
    elif args.data:
        data_dir, default_cache = Path(args.data), Path("artifacts") / "baselines"
    else:
        raise UserError("--baselines-only needs --data DIR (or a --bundle that records its data directory)")
    protocol = protocol or "paper"
    data = load_split_dir(data_dir)
    users = sample_users(data.eval_users(args.split), args.max_users)
    fit_on = fit_period(protocol, args.split)
    catalog = set(data.items) | {i for period in ("train", "valid", "test") for seq in getattr(data, period).values()
                                 for i in seq}
    beside = evaluate_baselines(data, args.split, ks, names, protocol, users, exclude,
                                cold=cold_items(data, fit_on, sorted(catalog)),
                                **_baseline_options(args, default_cache))
    result = {"split": args.split, "users": len(users), "ks": ks, "exclude_history": exclude,
              "data": str(data_dir), **beside}
    print(f"{args.split}: {len(users)} users, protocol {protocol}, baselines only")
    print(baselines_table(result))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0
