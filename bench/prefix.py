"""`recsvc bench prefix`: is every served top-k the head of the served top-B? (the beam width contract)

For each user, the served recommender (the bundle's prior, plain decoding, beam width B) is asked for the top-B
and for each k of ``--k``; a user passes when every top-k equals the first k of the top-B (and, with a drafter,
when strict speculative decoding returns the same lists). Counts go to the JSON and BENCHMARKS.md.

    recsvc bench prefix --bundle B --users 500 --k 1,5,10 --beam-width 20 --json prefix.json
"""

from __future__ import annotations

import argparse

from recsvc.bundle.loading import PRECISIONS
from recsvc.cli.args import parse_int_list, set_threads
from recsvc.data.split import EVAL_SPLITS
from recsvc.errors import UserError
from recsvc.hardware import machine
from recsvc.report.records import write_json

# one line of `recsvc bench --help`
HELP = "beam width contract: every top-k is the head of the top-B (counts)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True)
    p.add_argument("--users", type=int, default=500)
    p.add_argument("--k", default="1,5,10", help="the k values checked against the top-B")
    p.add_argument("--beam-width", type=int, default=20)
    p.add_argument("--split", choices=EVAL_SPLITS, default="test")
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", dest="json_path")


def run(args: argparse.Namespace) -> dict:
    from recsvc.bundle.directory import Bundle
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.hardware import resolve_dtype
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender
    from recsvc_base.progress import progress_bar

    set_threads(args.threads)
    ks = parse_int_list(args.k, "--k")
    if not 1 <= args.beam_width <= 100 or max(ks) > args.beam_width:
        raise UserError(f"--beam-width must lie in 1..100 and be >= every --k, got {args.beam_width}")
    rec = BundleRecommender.from_bundle(args.bundle, dtype=args.dtype, beam_width=args.beam_width)
    data = load_split_dir(Bundle.open(args.bundle).resolve_data_dir())
    users = sample_users(data.eval_users(args.split), args.users, 0)
    modes = ["plain"] + (["strict"] if rec.drafter is not None else [])
    passed = 0
    for u in progress_bar(users, desc=f"prefix B={args.beam_width}", leave=False):
        top = rec.recommend([RecQuery(history=u.history, k=args.beam_width, mode="plain")])[0].item_ids
        ok = True
        for k in ks:
            for mode in modes:
                ok &= rec.recommend([RecQuery(history=u.history, k=k, mode=mode)])[0].item_ids == top[:k]
        passed += ok
    payload = {"bench": "prefix", "beam_width": args.beam_width, "ks": ks, "modes": modes, "users": len(users),
               "passed": passed, "dtype": resolve_dtype(args.dtype), "machine": machine()}
    print(f"{passed}/{len(users)} users: every top-k (k in {ks}, {'/'.join(modes)}) is the head of the top-"
          f"{args.beam_width}")
    write_json(args.json_path, payload)
    return payload
