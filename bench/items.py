"""`recsvc bench items`: the item-level target's served request beside the token target's, in ONE run, and its
lists against exhaustive scoring of every catalog item.

Both bundles are loaded as the service loads them (``BundleRecommender.from_bundle``: the bundle's prior when
``--prior``, history excluded as ``--exclude-history`` says) and asked the same users' plain requests of k items at
the served beam width, one request at a time, interleaved (paired A/B: machine noise hits both alike). Paths:
- ``items``: a new user (no user-state cache): the timeline forward, then the decoder's L steps;
- ``items-repeat``: the same request again with a user-state cache that holds it: the kept search output;
- ``tokens``: the token target's served plain request (no user-state cache), the bundle's forward plan;
- ``tokens-repeat``: its identical repeat with a user-state cache (prompt and decode steps replayed).
Per path: p50 / mean ms per request and target forward calls per request (the item-level target: the timeline's
one plus the decoder's L). Then, without the prior, each user's item-level list against the top k of exhaustive
scoring of every catalog item's code path (``recsvc.timeline.search.exhaustive_scores``, history excluded as
served): the share of identical lists, of identical sets, and the mean overlap.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from recsvc.cli.args import set_threads
from recsvc.hardware import cpu_flags, machine
from recsvc.report.records import markdown_table, write_json

HELP = "the item-level target's served request vs the token target's (same users), and vs exhaustive scoring"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="a bundle of the item-level target (architecture items)")
    p.add_argument("--against", default=None, help="a token target's bundle, its served path measured beside")
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--beam-width", type=int, default=20,
                   help="beams searched by both targets (each request reads the first k; 0: the bundles' own)")
    p.add_argument("--split", choices=("valid", "test"), default="test")
    p.add_argument("--prior", action="store_true", help="fuse each bundle's prior, as served")
    p.add_argument("--exclude-history", action="store_true", help="leave each user's history items out")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the users (the p50 over all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")


def _width(rec, width: int):
    """``rec`` searching ``width`` beams (0: as its bundle serves)."""
    return rec.variant(beam_width=width) if width else rec


def _load(path: str, args: argparse.Namespace):
    from recsvc.recommender.bundle_recommender import BundleRecommender

    return BundleRecommender.from_bundle(path, dtype="auto", use_drafter=False, use_prior=args.prior,
                                         exclude_history=args.exclude_history, use_fresh=False, use_dense=False)


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.engine.caches.state_cache import UserStateCache
    from recsvc.errors import UserError
    from recsvc.recommender.api import RecQuery

    if args.users < 1 or args.k < 1 or args.repeats < 1:
        raise UserError("--users, --k and --repeats must be >= 1")
    set_threads(args.threads)
    if args.beam_width < 0:
        raise UserError("--beam-width must be >= 0")
    items = _width(_load(args.bundle, args), args.beam_width)
    if items.parts.timeline is None:
        raise UserError(f"{args.bundle} holds no item-level target (bundle.json architecture \"items\")")
    tokens = _width(_load(args.against, args), args.beam_width) if args.against else None
    data = load_split_dir(items.parts.bundle.resolve_data_dir())
    users = sample_users(data.eval_users(args.split), args.users, args.seed)
    queries = [RecQuery(history=list(u.history), k=args.k, mode="plain") for u in users]
    paths: dict[str, Any] = {"items": items.variant(states=None),
                             "items-repeat": items.variant(states=UserStateCache(256 << 20))}
    if tokens is not None:
        paths["tokens"] = tokens.variant(states=None)
        cache = UserStateCache(256 << 20) if tokens.target is not None and tokens.target.plan.fast else None
        paths["tokens-repeat"] = tokens.variant(states=cache)
    for rec in paths.values():  # warm: every path once per user (the repeats' caches filled)
        for q in queries:
            rec.recommend([q])
    times: dict[str, list[float]] = {name: [] for name in paths}
    calls: dict[str, list[int]] = {name: [] for name in paths}
    lists: dict[str, list[list[int]]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for q in queries:
            for name, rec in paths.items():
                t0 = time.perf_counter()
                res = rec.recommend([q])[0]
                times[name].append(1000 * (time.perf_counter() - t0))
                calls[name].append(res.stats.target_calls)
                lists[name].append(res.item_ids)
    rows = []
    for name in paths:
        rows.append({"path": name, "p50_ms": round(statistics.median(times[name]), 3),
                     "mean_ms": round(statistics.fmean(times[name]), 3),
                     "target_calls": round(statistics.fmean(calls[name]), 2)})
    out: dict[str, Any] = {"bench": "items", "machine": machine(), "cpu_flags": [f for f in cpu_flags() if "bf16" in f
                                                                                 or "amx" in f],
                           "threads": args.threads, "k": args.k,
                           "beam_width": items.beam_width, "users": len(users), "prior": args.prior,
                           "exclude_history": args.exclude_history, "paths": rows,
                           "repeat_equals_new": lists["items-repeat"] == lists["items"]}
    if tokens is not None:
        p50 = {r["path"]: r["p50_ms"] for r in rows}
        out["items_over_tokens_p50"] = round(p50["items"] / p50["tokens"], 3)
    out["exhaustive"] = _exhaustive(items, users, args)
    print(markdown_table(rows, [("path", "path"), ("p50_ms", "p50 ms"), ("mean_ms", "mean ms"),
                                ("target_calls", "target calls / request")]))
    print({k: v for k, v in out.items() if k not in ("paths", "machine")})
    if args.json_path:
        write_json(args.json_path, out)
    return out


def _exhaustive(items, users, args: argparse.Namespace) -> dict[str, Any]:
    """The served lists without the prior against the top k of every catalog item's path score."""
    from recsvc.recommender.api import RecQuery
    from recsvc.timeline.search import exhaustive_scores, user_states

    plain = items.variant(states=None, prior=None)
    trie, model = items.parts.trie, items.parts.timeline
    leaf = trie.item_path[:, -1]
    same_list = same_set = 0
    overlap = []
    for u in users:
        served = plain.recommend([RecQuery(history=list(u.history), k=args.k, mode="plain")])[0].item_ids
        scores = exhaustive_scores(model, trie, user_states(model, trie, [u.history]))[0]
        if args.exclude_history:
            dead = trie.dead_nodes([u.history])[0]
            scores = scores.masked_fill(dead[leaf], float("-inf"))
        top = trie.ids.item_ids[scores.topk(args.k).indices.numpy()].tolist()
        same_list += served == top
        same_set += set(served) == set(top)
        overlap.append(len(set(served) & set(top)) / args.k)
    n = len(users)
    return {"users": n, "same_lists": round(same_list / n, 4), "same_sets": round(same_set / n, 4),
            "overlap": round(statistics.fmean(overlap), 4)}
