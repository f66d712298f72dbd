"""`recsvc bench cache`: today's forward vs the fast and compiled forwards vs a returning user's state, in ONE run.

The same users, one request at a time, the served recommender (plain decoding, the bundle's prior, the beam
width B), five paths per user, interleaved (paired A/B: machine noise hits all of them alike):
- ``lean``: the request as served before the engine's speed work: the previous engine forward (``--forward
  lean``) and the fused prior's numpy implementation (``recsvc.priors.reference``), no user-state cache;
- ``fast``: the fast forward (recsvc.engine.kernels.fast), no user-state cache (a new user);
- ``compiled``: the fast forward with its layers compiled (recsvc.engine.kernels.compiled_stack, ``--forward
  compiled``), no user-state cache (left out with ``--no-compiled``);
- ``cached``: the ``--state-forward`` (compiled by default), the user's prompt state cached by an earlier request
  with the same prompt but other beams (beam width B + 5): the prompt forward skipped, the decode steps run;
- ``repeat``: the same forward, the user's earlier request identical (same prompt, k, B, exclusions, prior):
  the prompt and every decode step replayed from the cache, no forward.
Per path: p50 / mean ms per request, target forwards and tokens (rows x new tokens, summed over the forwards)
per request (the fast and compiled paths run the bounded last step, ``recsvc.engine.search.last_step``: fewer tokens,
sometimes one forward more), and the fixed cost per forward from the
forward ledger (``recsvc.engine.meters.ledger.ForwardLedger``: the intercept of ms vs new tokens over a sweep of
plain searches of K = 1..40 beams, so 1..40 tokens per decode forward), for the target and, when the bundle
has them, the LLaMA drafter and the draft head (its step: a few matmuls, no transformer forward).
Outputs: ``fast`` and ``compiled`` vs ``lean`` (same items in the same order; float rounding may reorder
near-ties) and ``cached`` / ``repeat`` vs the uncached path of their forward (identical items and scores).
The linear-layer floor (``bench.floor``): the target's packed linears alone, back to back, at 1 row
(weight streaming per forward), at an uncached request's row counts (a prompt of the users' median length + the
decode forwards at B beams) and at a prompt-cached one's (the decode forwards), each over the lean p50: the
best ratio a path that runs every beam can reach with these weights in this dtype on this machine (the bounded
last step runs fewer rows, so it can go below it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING

import torch

from recsvc.bundle.loading import PRECISIONS
from recsvc.cli.args import set_threads
from recsvc.data.split import EVAL_SPLITS
from recsvc.engine.kernels.plan import forward_names
from recsvc.hardware import machine
from recsvc.report.records import markdown_table, write_json
from recsvc_base.progress import progress_bar

if TYPE_CHECKING:
    from recsvc.bundle.directory import Bundle
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.recommender.bundle_recommender import BundleRecommender

PATHS = ("lean", "fast", "compiled", "cached", "repeat")
UNCACHED = ("lean", "fast", "compiled")  # forwards without a user-state cache
SWEEP_K = (1, 2, 5, 10, 20, 40)

# one line of `recsvc bench --help`
HELP = ("previous forward vs fast forward vs a returning user's cached state, one run: ms/request, "
        "forwards/request, fixed ms per forward, identical outputs")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True)
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--beam-width", type=int, default=20, help="beams searched per request (the served B)")
    p.add_argument("--split", choices=EVAL_SPLITS, default="test")
    p.add_argument("--dtype", choices=PRECISIONS, default="fp32")
    p.add_argument("--data", help="data directory (default: the bundle's)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--warmup", type=int, default=10, help="training users run through every path first")
    p.add_argument("--sweep-users", type=int, default=10, help="users of the fixed-cost sweep (K = 1..40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-forward", choices=forward_names(static=False), default="compiled",
                   help="the forward of the user-state cache's paths (cached, repeat), compared with the same "
                        "forward uncached")
    p.add_argument("--no-compiled", action="store_true",
                   help="leave out the compiled forward (no C++ compiler, or a quick run): no compiled row, and the "
                        "cached paths run the fast forward")
    p.add_argument("--llama-drafter", default="auto",
                   help="the LLaMA drafter whose fixed cost per forward is measured beside the target's: a name "
                        "under BUNDLE/drafters/, 'drafter' (BUNDLE/drafter), 'auto' (the served drafter when it is a "
                        "LLaMA drafter, else BUNDLE/drafter when the bundle has one) or 'none'")
    p.add_argument("--json", dest="json_path")


def _users(bundle: Bundle, n: int, split: str, data_dir: str | None, seed: int):
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir

    data = load_split_dir(bundle.resolve_data_dir(data_dir))
    users = sample_users(data.eval_users(split), n, seed)
    train = [items for items in data.train.values() if items]
    return [list(u.history) for u in users], train


def _fixed_cost(model, search, prompts, k_values=SWEEP_K) -> tuple[float, float]:
    """(fixed ms per forward, ms per token) of ``model`` from plain searches of every K in ``k_values``."""
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.meters.ledger import ForwardLedger

    ledger = ForwardLedger()
    for k in k_values:  # warm each width once, then record
        search(PromptBatch.from_lists([prompts[0]]), k)
    model.forward_ledger = ledger
    try:
        for p in prompts:
            for k in k_values:
                first = len(ledger.calls)
                search(PromptBatch.from_lists([p]), k)
                del ledger.calls[first]  # the prompt forward: the fit is over decode forwards (k tokens)
    finally:
        model.forward_ledger = None
    return ledger.fit()


def _head_step_ms(rec, rows: int = 20, reps: int = 200) -> float | None:
    """ms per step of the draft head (``DraftHead.step`` on ``rows`` beams), None without a head."""
    head = rec.drafter.draft_head if rec.drafter is not None else None
    if head is None:
        return None
    h = torch.zeros(rows, rec.target.hidden_size)
    with torch.inference_mode():
        state = head.start(h)
        codes, level = torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.long)
        for _ in range(10):
            head.step(state, h, level, codes)
        start = time.perf_counter()
        for _ in range(reps):
            head.step(state, h, level, codes)
    return 1000.0 * (time.perf_counter() - start) / reps


def _llama_drafter(rec: BundleRecommender, bundle: Bundle, args: argparse.Namespace) -> EngineModel | None:
    """The ``EngineModel`` of the LLaMA drafter ``--llama-drafter`` names (None: 'none', or 'auto' and the bundle has
    none); built in the target's attention mode, as the serving registry builds it."""
    from recsvc.engine.kernels.engine_model import EngineModel

    name = args.llama_drafter
    if name == "none":
        return None
    if name == "auto":
        served = rec.drafter.model if rec.drafter is not None else None
        if served is not None:
            return served
        if not (bundle.drafter_dir / "config.json").is_file():
            return None
        name = "drafter"
    model = bundle.load_drafter(dtype=args.dtype, name=name)  # UserError when it is missing
    return EngineModel.build(model, rec.target.attention)


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    from bench import floor
    from recsvc.bundle.directory import Bundle
    from recsvc.engine.caches.state_cache import UserStateCache
    from recsvc.engine.meters.ledger import ForwardLedger
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.hardware import resolve_dtype
    from recsvc.priors.mixed import MixedPrior
    from recsvc.priors.reference import ReferenceMixedPrior
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender

    set_threads(args.threads)
    bundle = Bundle.open(args.bundle)
    rec = BundleRecommender.from_bundle(args.bundle, dtype=args.dtype, attention="fp32", beam_width=args.beam_width,
                                        exclude_history=bundle.serves_excluding_history())  # as served
    drafter_model = _llama_drafter(rec, bundle, args)  # before any timing: a missing drafter is a clear error
    histories, train = _users(bundle, args.users, args.split, args.data, args.seed)
    target = rec.target
    caches = {"cached": UserStateCache(1 << 40, "bench"), "repeat": UserStateCache(1 << 40, "bench")}

    served_prior = rec.prior  # lean: the prior's numpy reference (the same distribution up to float32 rounding)
    lean_prior = ReferenceMixedPrior.of(served_prior) if isinstance(served_prior, MixedPrior) else served_prior
    paths = tuple(p for p in PATHS if p != "compiled") if args.no_compiled else PATHS
    uncached = tuple(p for p in UNCACHED if p in paths)
    state_forward = "fast" if args.no_compiled else args.state_forward
    # the variants compared, built from the one loaded recommender (models shared): each path's cache and prior
    variants = {path: rec.variant(states=caches.get(path), prior=lean_prior if path == "lean" else served_prior)
                for path in paths}
    repeat = rec.variant(states=caches["repeat"])  # the user's earlier request: identical
    wider = rec.variant(states=caches["cached"], beam_width=args.beam_width + 5)  # ... with other beams

    def one(path: str, history: list[int]):
        target.set_forward(path if path in uncached else state_forward)
        target.forward_ledger = ledger = ForwardLedger()  # the tokens each forward ran
        start = time.perf_counter()
        out = variants[path].recommend([RecQuery(history=history, k=args.k, mode="plain")])[0]
        elapsed = 1000.0 * (time.perf_counter() - start)
        target.forward_ledger = None
        tokens[path].append(sum(t for t, _ in ledger.calls))
        return out, elapsed

    tokens: dict[str, list[int]] = {p: [] for p in paths}
    for h in train[: args.warmup]:
        for path in paths:
            one(path, h)
    tokens = {p: [] for p in paths}  # the warm-up's are not counted
    ms: dict[str, list[float]] = {p: [] for p in paths}
    calls: dict[str, list[int]] = {p: [] for p in paths}
    same = dict.fromkeys(paths, 0)  # vs lean (items) / vs the uncached state_forward
    max_diff = {"fast": 0.0, "compiled": 0.0}
    for i, h in enumerate(progress_bar(histories, desc="bench cache", leave=False)):
        order = paths[i % len(paths):] + paths[: i % len(paths)]  # rotate: no path always runs first
        target.set_forward(state_forward)
        repeat.recommend([RecQuery(history=h, k=args.k, mode="plain")])
        wider.recommend([RecQuery(history=h, k=args.k, mode="plain")])
        res = {}
        for path in order:
            res[path], t = one(path, h)
            ms[path].append(t)
            calls[path].append(res[path].stats.target_calls)
        for path in uncached[1:]:
            if res[path].item_ids == res["lean"].item_ids:
                same[path] += 1
                max_diff[path] = max([max_diff[path], *(abs(a - b) for a, b in zip(
                    res[path].scores, res["lean"].scores, strict=True))])
        for path in ("cached", "repeat"):
            same[path] += (res[path].item_ids == res[state_forward].item_ids
                           and res[path].scores == res[state_forward].scores)
    sweep = [rec.prompts.prompt_ids(h) for h in histories[: args.sweep_users]]
    fixed = {}
    for name in uncached:
        target.set_forward(name)
        fixed[name] = _fixed_cost(target, BeamSearch(target, rec.trie, rec.prompts.code_offset).search, sweep)
    drafter_fixed = None
    if drafter_model is not None:
        drafter_fixed = {}
        for name in uncached:
            drafter_model.set_forward(name)
            drafter_fixed[name] = _fixed_cost(drafter_model, BeamSearch(drafter_model, rec.trie,
                                                                        rec.prompts.code_offset).search, sweep)
    target.set_forward("fast")
    prompt_tokens = round(statistics.median(len(rec.prompts.prompt_ids(h)) for h in histories))
    floors = floor.measure(target, prompt_tokens, args.beam_width, rec.trie.levels - 1)
    target.set_forward("auto")
    rows = []
    base = statistics.median(ms["lean"])
    for path in paths:
        f = fixed[path if path in uncached else state_forward]
        rows.append({"path": path, "p50_ms": statistics.median(ms[path]), "mean_ms": statistics.mean(ms[path]),
                     "vs_lean": statistics.median(ms[path]) / base,
                     "forwards_per_request": statistics.mean(calls[path]),
                     "tokens_per_request": statistics.mean(tokens[path]),
                     "fixed_ms_per_forward": f[0], "ms_per_token": f[1]})
    n = len(histories)
    payload = {"bench": "cache", "bundle": str(args.bundle), "dtype": resolve_dtype(args.dtype), "k": args.k,
               "beam_width": args.beam_width, "exclude_history": rec.exclude_history, "split": args.split, "users": n,
               "machine": machine(),
               "rows": rows, "state_forward": state_forward,
               "identical_items_fast_vs_lean": same["fast"] / n, "max_score_diff_fast_vs_lean": max_diff["fast"],
               "identical_items_compiled_vs_lean": same["compiled"] / n if "compiled" in paths else None,
               "max_score_diff_compiled_vs_lean": max_diff["compiled"] if "compiled" in paths else None,
               "identical_cached_vs_uncached": same["cached"] / n, "identical_repeat_vs_uncached": same["repeat"] / n,
               "drafter_fixed_ms_per_forward": ({k: v[0] for k, v in drafter_fixed.items()}
                                                if drafter_fixed else None),
               "head_step_ms": _head_step_ms(rec), "floor_measured": floor.MEASURED, **(floors or {})}
    if floors:
        payload["floor_uncached_vs_lean"] = floors["floor_uncached_ms"] / base
        payload["floor_cached_vs_lean"] = floors["floor_cached_ms"] / base
    print(markdown_table(rows, [("path", "path"), ("p50_ms", "p50 ms/req"), ("mean_ms", "mean ms/req"),
                                ("vs_lean", "p50 vs lean"), ("forwards_per_request", "forwards/req"),
                                ("tokens_per_request", "tokens/req"), ("fixed_ms_per_forward", "fixed ms/forward"),
                                ("ms_per_token", "ms/token")]))
    vs_lean = ", ".join(f"{p} {same[p]}/{n} (max score diff {max_diff[p]:.2e})" for p in uncached[1:])
    print(f"identical items vs lean: {vs_lean}; with the {state_forward} forward, cached == uncached (items and "
          f"scores): {same['cached']}/{n}; repeat == uncached: {same['repeat']}/{n}")
    if drafter_fixed:
        print("LLaMA drafter fixed ms/forward: " + ", ".join(f"{k} {v[0]:.3f}" for k, v in drafter_fixed.items()))
    if floors:
        print(f"linear floor ({floor.MEASURED}, {floors['floor_reps']} passes):")
        print(f"  1 row: {floors['floor_ms_per_forward']:.3f} ms/forward ({floors['weight_bytes'] / 1e6:.1f} MB of "
              f"weights: {floors['weight_GBps']:.1f} GB/s)")
        print(f"  uncached request (prompt of {prompt_tokens} tokens + {floors['floor_decode_forwards']} decode "
              f"forwards of {args.beam_width} beams): {floors['floor_uncached_ms']:.2f} ms = "
              f"{payload['floor_uncached_vs_lean']:.2f} x lean p50")
        print(f"  prompt-cached request (the decode forwards): {floors['floor_cached_ms']:.2f} ms = "
              f"{payload['floor_cached_vs_lean']:.2f} x lean p50")
    else:
        print("linear floor: not measured (the fast forward does not serve this model)")
    if payload["head_step_ms"] is not None:
        print(f"draft head: {payload['head_step_ms']:.3f} ms per step (20 beams)")
    write_json(args.json_path, payload)
    return payload
