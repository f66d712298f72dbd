"""``recsvc refresh``: the daily refresh (``run``) and a split replayed as days to measure it (``replay``).

    recsvc refresh run --bundle current --log day.csv --out versions/2026-12-03 --publish current
    recsvc refresh replay --bundle artifacts/beauty-items/bundle --days 5 --out artifacts/replay --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recsvc.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    from training.data.cli import columns_arg
    from training.data.import_log import LOG_COLUMNS

    p = subparsers.add_parser("refresh", help="today's bundle from yesterday's + the day's interactions, gated")
    sub = p.add_subparsers(dest="refresh_command", metavar="{run,replay}", required=True)
    r = sub.add_parser("run", help="one refresh: continue yesterday's models on the appended day, gate, publish")
    r.add_argument("--bundle", type=Path, required=True,
                   help="yesterday's bundle (an items bundle; a symlink such as the served `current` is followed)")
    r.add_argument("--log", type=Path, required=True,
                   help="the interactions appended since (CSV or Parquet; `recsvc data import`'s columns and rules)")
    r.add_argument("--out", type=Path, required=True, help="today's bundle directory (new; a re-run resumes it)")
    r.add_argument("--publish", type=Path, default=None,
                   help="the symlink `recsvc serve --bundle` follows: pointed at --out when the gate passes")
    r.add_argument("--catalog", type=Path, default=None,
                   help="the live catalog the server reads (default: BUNDLE/catalog_live.json): its added items "
                        "join today's catalog")
    r.add_argument("--columns", type=columns_arg(LOG_COLUMNS), default={},
                   help="the log's column names, ROLE=NAME,... (roles user, item, time, rating)")
    r.add_argument("--min-rating", type=float, default=None, help="keep rows with rating >= this")
    r.add_argument("--missing-items", choices=("drop", "error"), default="drop",
                   help="a row whose item key the catalog lacks: dropped and counted, or an error")
    _plan_args(r)
    r.set_defaults(func=_run)

    y = sub.add_parser("replay", help="a split's validation period replayed as days, refreshed day by day, against "
                                      "the from-scratch bundle on the test period")
    y.add_argument("--bundle", type=Path, required=True,
                   help="the from-scratch items bundle (deploy protocol: BUNDLE/target-train is day 0's target)")
    y.add_argument("--days", type=int, default=5)
    y.add_argument("--out", type=Path, required=True)
    y.add_argument("--corrupt-day", type=int, default=None,
                   help="shuffle this day's item keys (the gate must keep that refresh aside)")
    y.add_argument("--seed", type=int, default=0, help="seed of the days' times and of the corruption")
    _plan_args(y)
    y.set_defaults(func=_replay)


def _plan_args(p: argparse.ArgumentParser) -> None:
    from training.refresh.gate import GateRule
    from training.refresh.models import ContinuePlan

    plan, rule = ContinuePlan(), GateRule()
    p.add_argument("--epochs", type=int, default=plan.target_epochs, help="the target's epochs from yesterday's")
    p.add_argument("--lr", type=float, default=plan.target_lr, help="the target's peak learning rate")
    p.add_argument("--sasrec-epochs", type=int, default=plan.sasrec_epochs,
                   help="the prior's SASRec epochs from yesterday's (0: yesterday's as it is)")
    p.add_argument("--tolerance", type=float, default=rule.tolerance,
                   help="kept aside when today / yesterday NDCG@10's 95%% interval lies wholly below 1 - this")
    p.add_argument("--min-day-share", type=float, default=rule.min_day_share,
                   help="kept aside when yesterday ranks the day below this share of its own validation NDCG@10")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def _plan(args: argparse.Namespace):
    import torch

    from recsvc.hardware import native_bf16
    from training.refresh.gate import GateRule
    from training.refresh.models import ContinuePlan

    if args.epochs < 1 or args.sasrec_epochs < 0 or args.lr <= 0:
        raise UserError("--epochs must be >= 1, --sasrec-epochs >= 0 and --lr > 0")
    if not 0 <= args.tolerance < 1 or not 0 <= args.min_day_share <= 1:
        raise UserError("--tolerance must lie in [0, 1) and --min-day-share in [0, 1]")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    bf16 = args.bf16 == "on" or (args.bf16 == "auto" and native_bf16())
    return (ContinuePlan(target_epochs=args.epochs, target_lr=args.lr, sasrec_epochs=args.sasrec_epochs, bf16=bf16),
            GateRule(tolerance=args.tolerance, min_day_share=args.min_day_share))


def _run(args: argparse.Namespace) -> int:
    from training.data.import_log import LOG_COLUMNS
    from training.refresh.run import KEPT_ASIDE, RefreshRequest, log_line, refresh

    plan, rule = _plan(args)
    try:
        cols = LOG_COLUMNS.given(args.columns)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    record = refresh(RefreshRequest(args.bundle, args.log, args.out, args.publish, args.catalog, cols, args.min_rating,
                                    args.missing_items, plan, rule))
    print(log_line(record, args.out), flush=True)
    if not record["passed"]:
        print(f"kept aside, not published: {record['reason']}", file=sys.stderr)
        return KEPT_ASIDE
    return 0


def _replay(args: argparse.Namespace) -> int:
    from training.refresh.day_replay import replay

    if args.days < 1:
        raise UserError("--days must be >= 1")
    if args.corrupt_day is not None and not 1 <= args.corrupt_day <= args.days:
        raise UserError(f"--corrupt-day must be one of 1..{args.days}")
    plan, rule = _plan(args)
    result = replay(args.bundle, args.out, args.days, plan, rule, args.corrupt_day, args.seed)
    print(json.dumps(result["summary"], indent=1))
    return 0
