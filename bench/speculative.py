"""`recsvc bench speculative`: plain vs speculative beam search on the same engine, users and K.

Per K: plain and speculative ms/request (measured interleaved, user by user, in one run), WS@K (their
ratio), AS@K (accepted draft depths per request), target forward calls per request, the identical-output
rate (strict) or Recall@K / NDCG@K of both (relaxed; the baseline is the target's own sampling beam search).
Each row also counts, on a few users' untimed requests (``--count-users``), the eager device operations, graph
replays and host reads per request of both (``bench.counts``; ``--forward bucketed``: the CUDA graphs' path).
Every (N, gamma) of the grid is measured, then ``auto``: chosen among plain beam search and the grid on
calibration users from the validation split (as the server does at start-up), then measured like the others.
N = 0 in a row means auto chose plain beam search. ``--mode head`` (``--drafter head``): the draft head's beams
accepted without verification (``recsvc.drafters.head_alone``: one target forward), timed against plain beam
search, with Recall@K / NDCG@K of both and the share of identical lists.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from bench.common import PRIOR_USES, BenchContext, add_bundle_bench_args, load_context, synchronize
from bench.counts import count_requests
from recsvc.cli.args import parse_int_list, set_threads
from recsvc.engine.kernels.plan import forward_names
from recsvc.engine.meters.ledger import NO_LEDGER, PhaseLedger
from recsvc.engine.scoring.prior import prior_log_mass
from recsvc.engine.speculation.relaxed.keep import DEFAULT_KEEP, KEEPS
from recsvc.hardware import machine, resolve_dtype
from recsvc.recommender.api import SPECULATIVE
from recsvc.recommender.drafter_names import DRAFTER_KINDS, HEAD_OPENERS
from recsvc.report.records import markdown_table, write_json
from recsvc_base.progress import progress_bar

# one line of `recsvc bench --help`
HELP = "plain vs speculative beam search: WS@K, AS@K, target calls"


def add_args(p: argparse.ArgumentParser) -> None:
    add_bundle_bench_args(p, "1,3,5,10,20", attention="fp32")
    p.add_argument("--mode", choices=(*SPECULATIVE, "head"), default="strict",
                   help="head (with --drafter head): the head's beams accepted without verification (one target "
                        "forward, the head beam-searches the other codes), its quality against plain decoding's")
    p.add_argument("--drafter", choices=DRAFTER_KINDS, default="llama",
                   help="transition: drafts from the bundle's item-transition prior (no network; needs BUNDLE/prior); "
                        "head: the recurrent draft head on the target (BUNDLE/head, `recsvc train head`)")
    p.add_argument("--drafter-name", "--head-name", dest="drafter_name", default=None,
                   help="a trained drafter by name: --drafter head: BUNDLE/heads/NAME instead of BUNDLE/head; "
                        "--drafter llama: BUNDLE/drafters/NAME instead of BUNDLE/drafter")
    p.add_argument("--head-opener", choices=HEAD_OPENERS, default="auto",
                   help="--drafter head: who drafts the first round, fused with the prompt prefill (auto: the "
                        "transition drafter when the bundle has a prior; none: the head after a prefill forward)")
    p.add_argument("--prior", choices=PRIOR_USES, default="auto",
                   help="auto: plain and speculative both fuse the bundle's prior when it has one (as served)")
    p.add_argument("--grid", default="auto", help="'auto' (measure the grid, then auto) or N:gamma pairs, N a "
                   "number or relative to each K (K, 2K, K/2), gamma 1..5: e.g. 10:3,20:2 or K:3,2K:3")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--relaxed-keep", choices=KEEPS, default=DEFAULT_KEEP,
                   help="--mode relaxed: which K of >= K accepted drafts a depth keeps: the first K in the drafter's "
                        "draw order, or K uniformly at random (the AtSpeed paper's listing; docs/SPECULATIVE.md)")
    p.add_argument("--calibration-users", type=int, default=8)
    p.add_argument("--forward", choices=["auto", *forward_names()], default="auto",
                   help="the engine forward of the target and a LLaMA drafter (bucketed: the CUDA graphs' shapes, "
                        "uncaptured; auto: recsvc.engine.kernels.plan)")
    p.add_argument("--exit-check", type=int, default=0,
                   help="strict over a sync-free forward: one more host read after this many rounds ends a finished "
                        "request early (0: none; the request reads once, at the end of its L rounds)")
    p.add_argument("--count-users", type=int, default=3,
                   help="users whose requests are run again, untimed, to count per request the eager device ops, "
                        "graph replays and host reads of plain and speculative decoding (0: none)")


def make_drafter(kind: str, ctx: BenchContext, engine, k: int, dtype: str, drafter_name: str | None = None,
                 head_opener: str = "auto", device: str = "cpu"):
    """The drafter ``kind`` (``recsvc.recommender.drafter_registry``; llama: BUNDLE/drafter, or
    BUNDLE/drafters/``drafter_name``; head: BUNDLE/head or BUNDLE/heads/``drafter_name``) over the bench's trie;
    the transition drafter and the head's opener use BUNDLE/prior."""
    from recsvc.priors.transition import TransitionPrior
    from recsvc.recommender.drafter_registry import TAKES_NAME, DraftSource, build_drafter

    bundle = ctx.bundle
    prior = TransitionPrior.load(bundle.prior_dir) if kind in ("head", "transition") and bundle.has_prior() else None
    name = f"{kind}:{drafter_name}" if kind in TAKES_NAME and drafter_name else kind
    return build_drafter(name, DraftSource(bundle, engine.model, ctx.trie, ctx.builder.code_offset, dtype, device,
                                           prior=prior, sequences=lambda: ctx.data.train.values(), oracle_width=k,
                                           head_opener=head_opener))


def parse_grid(text: str) -> list[tuple[str, int]] | None:
    """'auto' -> None; else N:gamma pairs where N is a number or relative to K: 'K', '2K', 'K/2'.

    Example: parse_grid("K:3,20:2") == [("K", 3), ("20", 2)]."""
    from recsvc.errors import UserError

    if text == "auto":
        return None
    pairs = []
    for item in text.split(","):
        n, _, gamma = item.partition(":")
        if not (n.isdigit() or n in ("K", "2K", "K/2")) or not gamma.isdigit() or not 1 <= int(gamma) <= 5:
            raise UserError(f"--grid takes N:gamma pairs (N a number, K, 2K or K/2; gamma 1..5), got {text!r}")
        if n.isdigit() and int(n) < 1:
            raise UserError(f"--grid: N must be >= 1, got {text!r}")
        pairs.append((n, int(gamma)))
    return pairs


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    from recsvc.data.metrics import evaluate_rankings
    from recsvc.data.sampling import sample_users
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.entry.dispatch import decode
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.engine.search.sampling import make_generators
    from recsvc.engine.speculation.autotune import DEFAULT_GRID, autotune, resolve_grid

    set_threads(args.threads)
    ks = parse_int_list(args.k, "--k")
    fixed_grid = parse_grid(args.grid)
    device = getattr(args, "device", "cpu")
    ctx = load_context(args.bundle, args.users, args.split, args.dtype, args.data, device=device)
    target = EngineModel.build(ctx.model, args.attention, forward=getattr(args, "forward", "auto"))
    engine = BeamSearch(target, ctx.trie, ctx.builder.code_offset)
    calib = sample_users(ctx.data.eval_users("valid"), args.calibration_users, seed=1)
    relaxed, alone = args.mode == "relaxed", args.mode == "head"
    if alone and args.drafter != "head":
        from recsvc.errors import UserError

        raise UserError("--mode head takes --drafter head (the draft head accepted without verification)")
    temp = torch.tensor([args.temperature], device=device)
    fused = load_fused_prior(ctx.bundle_dir, args.prior)

    def prior_for(history):  # [1, num_nodes] the bundle's fused prior (inside the timed region), or None
        if fused is None:
            return None
        return prior_log_mass(ctx.trie, fused.probs([history]), fused.settings.weight)

    mode = "relaxed" if relaxed else "strict"

    def spec_once(user_history, k, n, gamma, drafter, seed=0, ledger=NO_LEDGER):
        if alone:
            return head_once(user_history, k, drafter)
        if n == 0:  # autotune chose not to speculate: plain (or sampling) beam search
            leaves, ms, calls = plain_once(user_history, k, seed, ledger)
            return leaves, ms, calls, 0, 0
        pb = PromptBatch.from_lists([ctx.builder.prompt_ids(user_history)])
        session = None
        if args.drafter == "oracle" and not relaxed:  # its plain search happens in session(): untimed
            session = drafter.session(pb, [user_history], None, prior_for(user_history))
        start = time.perf_counter()
        pr = prior_for(user_history)
        if args.drafter != "oracle" and not relaxed:  # setting up the draft (retrieval lookups, prior masses)
            with ledger.phase("draft"):  # is drafting time
                session = drafter.session(pb, [user_history], None, pr)
        if relaxed and not drafter.samples:  # else decode would answer with the target's own sampling
            drafter.sampling_session(pb, [user_history], None, pr)  # the drafter's UserError
        out = decode(engine, drafter, pb, [user_history], mode, k, (n, gamma), prior=pr, temperatures=temp,
                     generators=make_generators([seed]), session=session, ledger=ledger,
                     exit_check=getattr(args, "exit_check", 0) or None,
                     keep=getattr(args, "relaxed_keep", DEFAULT_KEEP))
        synchronize(device)  # CUDA: the request's work is done before the clock is read
        ms = 1000 * (time.perf_counter() - start)
        return out.leaves[0], ms, out.target_calls[0], out.accepted[0], out.draft_calls

    def head_once(user_history, k, drafter):  # --mode head: one target forward, the head's beam search
        from recsvc.recommender.drafter_registry import head_alone_search

        pb = PromptBatch.from_lists([ctx.builder.prompt_ids(user_history)])
        start = time.perf_counter()
        out = head_alone_search(target, ctx.trie, ctx.builder.code_offset, pb, k, drafter,
                                prior=prior_for(user_history))
        synchronize(device)
        return out.leaves[0], 1000 * (time.perf_counter() - start), out.target_calls, 0, 0

    def plain_once(user_history, k, seed=0, ledger=NO_LEDGER):
        pb = PromptBatch.from_lists([ctx.builder.prompt_ids(user_history)])
        start = time.perf_counter()
        pr = prior_for(user_history)  # relaxed without a drafter: the target's own sampling beam search
        out = decode(engine, None, pb, [user_history], "relaxed" if relaxed else "plain", k, (0, 0), prior=pr,
                     temperatures=temp, generators=make_generators([seed]), ledger=ledger)
        synchronize(device)
        return out.leaves[0], 1000 * (time.perf_counter() - start), out.target_calls[0]

    rows = []
    for k in ks:
        drafter = make_drafter(args.drafter, ctx, engine, k, args.dtype, args.drafter_name, args.head_opener, device)
        if isinstance(getattr(drafter, "model", None), EngineModel) and getattr(args, "forward", "auto") != "auto":
            drafter.model.set_forward(args.forward)  # a LLaMA drafter runs the target's forward
        if alone:  # nothing to tune: the head decodes every code after the first
            settings = [(k, engine.trie.levels - 1)]
        else:
            candidates = resolve_grid(fixed_grid or DEFAULT_GRID, k)
            auto = autotune(lambda k_, n, g, d=drafter: sum(spec_once(u.history, k_, n, g, d)[1] for u in calib)
                            / 1e3, [k], lambda _k, c=candidates: c, repeats=1)[k]
            settings = [*candidates, auto]  # auto: chosen among plain + the candidates on calibration users
        for u in ctx.users[:2]:  # warm-up
            plain_once(u.history, k)
        for idx, (n, gamma) in enumerate(settings):
            label = "head" if alone else "auto" if idx == len(settings) - 1 else "fixed"
            plain_ms, spec_ms, calls, acc, draft_calls, same, shared = [], [], [], [], [], 0, []
            rank_plain, rank_spec = {}, {}
            led_p, led_s = PhaseLedger(), PhaseLedger()
            for i, u in enumerate(progress_bar(ctx.users, desc=f"K={k} N={n} g={gamma}", leave=False)):
                leaves_p, ms_p, _ = plain_once(u.history, k, seed=i, ledger=led_p)
                leaves_s, ms_s, c, a, dc = spec_once(u.history, k, n, gamma, drafter, seed=i, ledger=led_s)
                draft_calls.append(dc)
                plain_ms.append(ms_p)
                spec_ms.append(ms_s)
                calls.append(c)
                acc.append(a)
                same += torch.equal(leaves_p, leaves_s)
                rank_plain[u.user_id] = ctx.trie.leaf_items(leaves_p[leaves_p >= 0])
                rank_spec[u.user_id] = ctx.trie.leaf_items(leaves_s[leaves_s >= 0])
                shared.append(len(set(rank_plain[u.user_id]) & set(rank_spec[u.user_id])) / k)
            p, s = statistics.mean(plain_ms), statistics.mean(spec_ms)
            row = {"k": k, "setting": label, "N": n, "gamma": gamma, "plain_ms": p, "spec_ms": s, "WS": p / s,
                   "AS": statistics.mean(acc), "target_calls_plain": float(engine.trie.levels),
                   "target_calls_spec": statistics.mean(calls), "draft_calls": statistics.mean(draft_calls),
                   "users": len(ctx.users)}
            counted = ctx.users[:getattr(args, "count_users", 3)]  # untimed requests of their own
            row["per_request_plain"] = count_requests(
                [partial(plain_once, u.history, k) for u in counted], device)
            row["per_request_spec"] = count_requests(
                [partial(spec_once, u.history, k, n, gamma, drafter) for u in counted], device)
            if not relaxed:  # ms per request per phase (recsvc.engine.meters.ledger); "other" = the rest of the request
                n_u = len(ctx.users)
                for name, led, total in (("plain", led_p, p), ("spec", led_s, s)):
                    phases = {ph: v / n_u for ph, v in led.ms.items()}
                    row[f"phases_{name}_ms"] = {**phases, "other": total - sum(phases.values())}
            if relaxed or alone:  # lists that differ from the baseline's: their quality beside it
                m_p = evaluate_rankings(rank_plain, ctx.users, [k])
                m_s = evaluate_rankings(rank_spec, ctx.users, [k])
                row.update({"recall_plain": m_p[f"recall@{k}"], "recall_spec": m_s[f"recall@{k}"],
                            "ndcg_plain": m_p[f"ndcg@{k}"], "ndcg_spec": m_s[f"ndcg@{k}"]})
            row["identical"] = same / len(ctx.users)
            row["overlap"] = statistics.mean(shared)  # the share of the baseline's K items in the list
            rows.append(row)
            print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()})
    cols = [("k", "K"), ("setting", "setting"), ("N", "N"), ("gamma", "gamma"), ("plain_ms", "plain ms"),
            ("spec_ms", "spec ms"), ("WS", "WS"), ("AS", "AS"), ("target_calls_spec", "target calls (spec)")]
    cols += ([("recall_plain", "Recall plain"), ("recall_spec", "Recall spec"), ("ndcg_plain", "NDCG plain"),
              ("ndcg_spec", "NDCG spec")] if relaxed or alone else []) + [("identical", "identical")]
    table = markdown_table(rows, cols)
    print(table)
    payload = {"bench": "speculative", "mode": args.mode, "drafter": args.drafter,
               "relaxed_keep": getattr(args, "relaxed_keep", DEFAULT_KEEP) if relaxed else None,
               "prior": None if fused is None else {**vars(fused.settings), "fitted_on": fused.fitted_on},
               "dtype": resolve_dtype(args.dtype, device), "device": device,
               "split": args.split, "machine": machine(), "rows": rows, "table": table}
    write_json(args.json_path, payload)
    return payload


def load_fused_prior(bundle_dir, mode: str):
    """The bundle's transition prior when ``mode`` is "auto" and the bundle fuses one (weight > 0), else None."""
    from recsvc.bundle.directory import Bundle
    from recsvc.errors import UserError
    from recsvc.priors.mixed import load_prior

    if mode not in PRIOR_USES:
        raise UserError(f"--prior must be {' or '.join(PRIOR_USES)}, not {mode!r}")
    bundle = Bundle.open(bundle_dir)
    if mode == "off" or not bundle.has_prior():
        return None
    prior = load_prior(bundle.prior_dir)  # as served: mixed with SASRec when `recsvc tune mix` chose it
    return prior if prior.settings.weight > 0 else None
