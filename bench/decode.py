"""`recsvc bench decode`: the engine's plain beam search (through its one decoding entry,
``recsvc.engine.entry.dispatch``) vs transformers ``generate`` with the trie callback.

Same model, same users, one request at a time for both (latency per request); per K: ms/request of each,
their ratio, and the identical-output rate (same items in the same order). Both paths are warmed first on
prompts of every history length 0..max_history built from training items (not the measured users): the
engine's prefix cache keeps the shared header's rows per prompt length, so this measures a server in its
steady state (``--cold`` skips that warm-up).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import common
from recsvc.cli.args import parse_int_list, set_threads
from recsvc.hardware import machine, resolve_dtype
from recsvc.report.records import markdown_table, write_json
from recsvc_base.progress import progress_bar

# one line of `recsvc bench --help`
HELP = "engine beam search vs transformers generate (same model, same users)"


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_bundle_bench_args(p, "1,5,10,20", attention="exact")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cold", action="store_true",
                   help="no warm-up per prompt length (the first request of each length then pays the header)")


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    from recsvc.engine.caches.prompts import PromptBatch
    from recsvc.engine.entry.dispatch import Decoded, decode
    from recsvc.engine.kernels.engine_model import EngineModel
    from recsvc.engine.search.beam_search import BeamSearch
    from recsvc.engine.search.reference import generate_topk

    set_threads(args.threads)
    ks = parse_int_list(args.k, "--k")
    device = getattr(args, "device", "cpu")
    ctx = common.load_context(args.bundle, args.users, args.split, args.dtype, args.data, device=device)
    engine = BeamSearch(EngineModel.build(ctx.model, args.attention), ctx.trie, ctx.builder.code_offset)
    prompts = [ctx.builder.prompt_ids(u.history) for u in ctx.users]
    warm = warmup_prompts(ctx, args.warmup, args.cold)
    ref_trie = ctx.trie.to("cpu")  # generate's per-beam Python callback reads the trie on the host
    rows = []

    def plain(batch: PromptBatch, width: int) -> Decoded:  # the engine's one decoding entry, plain beam search
        return decode(engine, None, batch, [[]], "plain", width, (0, 0))

    for k in ks:
        for p in warm:  # warm both paths (allocator, kernels, the engine's per-length prefix rows)
            plain(PromptBatch.from_lists([p]), k)
        for p in warm[: args.warmup]:
            generate_topk(ctx.model, ref_trie, ctx.builder.code_offset, p, k)
        eng_ms, gen_ms, same = [], [], 0
        for p in progress_bar(prompts, desc=f"decode K={k}", leave=False):
            out, ms_e = common.timed(plain, PromptBatch.from_lists([p], device), k, device=device)
            (ref_codes, _), ms_g = common.timed(generate_topk, ctx.model, ref_trie, ctx.builder.code_offset, p, k,
                                         device=device)
            codes = ctx.trie.codes_of_nodes(out.leaves[0][out.leaves[0] >= 0]).tolist()
            same += [tuple(c) for c in codes] == ref_codes
            eng_ms.append(ms_e)
            gen_ms.append(ms_g)
        e, g = statistics.mean(eng_ms), statistics.mean(gen_ms)
        rows.append({"k": k, "engine_ms": e, "generate_ms": g, "speedup": g / e,
                     "identical_rate": same / len(prompts), "users": len(prompts)})
        print(f"K={k}: engine {e:.1f} ms, generate {g:.1f} ms, x{g / e:.2f}, identical {same}/{len(prompts)}")
    payload = {"bench": "decode", "bundle": str(ctx.bundle_dir), "dtype": resolve_dtype(args.dtype, device),
               "device": device,
               "split": args.split,
               "attention": args.attention, "warm_per_length": not args.cold,
               "machine": machine(), "rows": rows}
    print(markdown_table(rows, [("k", "K"), ("engine_ms", "engine ms/req"), ("generate_ms", "generate ms/req"),
                                ("speedup", "speedup"), ("identical_rate", "identical"), ("users", "users")]))
    write_json(args.json_path, payload)
    return payload


def warmup_prompts(ctx, n: int, cold: bool) -> list[list[int]]:
    """``n`` prompts of the first training users, plus (unless ``cold``) one prompt per history length
    0..max_history made of training items: none of them is a measured (valid/test) user's prompt."""
    train_users = [items for items in ctx.data.train.values() if items][: max(n, 1)]
    out = [ctx.builder.prompt_ids(items) for items in train_users[:n]]
    if not cold:
        pool = [i for items in train_users for i in items]
        out += [ctx.builder.prompt_ids((pool * (ctx.builder.max_history + 1))[:h])
                for h in range(ctx.builder.max_history + 1)]
    return out
