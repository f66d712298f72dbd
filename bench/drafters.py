"""`recsvc bench drafters`: drafter alignment methods compared like the AtSpeed paper's Table 1 (it loads the
aligned drafters and measures them through ``training.drafters.api``).

    recsvc bench drafters --bundle B --methods sft,wordkd,tvdkd,seqkd,atspeed-s,atspeed-r --k 1,5,10,20 \\
        --users 200 --json bench_drafters.json

Every method is a drafter saved as BUNDLE/drafters/<method>/ (``recsvc train drafter --method M --out-name M``;
"retrieval" names the training-free REST-style drafter, strict only; "drafter" the served BUNDLE/drafter).
Same target, same users. Per K and verification mode, each user's request is decoded by the target alone
(plain beam search; sampling beam search for relaxed) and then by speculative decoding with every drafter,
one request at a time, interleaved (``training.drafters.api.measure_acceptance``): WS@K = plain time / speculative
time, AS@K = accepted draft depths per request, target calls per request, and under relaxed verification
Recall@5 / NDCG@5 of the speculative output (K >= 5; the target's own sampling beam search as reference).
"""

from __future__ import annotations

import argparse

from recsvc.bundle.loading import PRECISIONS
from recsvc.cli.args import parse_int_list, set_threads
from recsvc.data.split import EVAL_SPLITS
from recsvc.engine.kernels.plan import ATTENTIONS
from recsvc.errors import UserError
from recsvc.hardware import machine, resolve_dtype
from recsvc.report.records import markdown_table, write_json

# one line of `recsvc bench --help`
HELP = "drafter alignment methods: WS@K, AS@K strict + relaxed (Table 1)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True)
    p.add_argument("--methods", default="sft,wordkd,tvdkd,seqkd,atspeed-s,atspeed-r",
                   help="drafters under BUNDLE/drafters/ (comma-separated; 'retrieval', 'drafter' also work)")
    p.add_argument("--k", default="1,5,10,20", help="K values (items returned)")
    p.add_argument("--users", type=int, default=200, help="sampled users of the split")
    p.add_argument("--split", choices=EVAL_SPLITS, default="test")
    p.add_argument("--modes", default="strict,relaxed", help="strict, relaxed, both (= strict,relaxed)")
    p.add_argument("--gamma", type=int, default=3, help="draft depths per round")
    p.add_argument("--n-mult", type=float, default=1.0, help="draft beams N = max(K, round(n_mult * K))")
    p.add_argument("--draft-beams", type=int, default=None,
                   help="a fixed N for every K: N = max(K, this) (the AtSpeed paper: 40); overrides --n-mult")
    p.add_argument("--temperature", type=float, default=1.0, help="relaxed mode's sampling temperature")
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--attention", choices=ATTENTIONS, default="fp32",
                   help="engine attention: exact (bit-identical to generate) or fp32 (what the service runs)")
    p.add_argument("--data", help="data directory (default: the bundle's)")
    p.add_argument("--seed", type=int, default=0, help="user sample")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", dest="json_path")


def tables(rows: list[dict], methods: list[str], ks: list[int], modes: list[str], recall_at: int = 5) -> str:
    """Markdown: one table per verification mode, a row per method, WS@K then AS@K columns (Table 1 style)."""
    out = []
    for mode in modes:
        cols = [("method", "Method")] + [(f"WS@{k}", f"WS@{k}") for k in ks] + [(f"AS@{k}", f"AS@{k}") for k in ks]
        cols += [(f"calls@{k}", f"calls@{k}") for k in ks]
        if mode == "relaxed":
            cols += [(f"recall@{recall_at}", f"Recall@{recall_at}"), (f"ndcg@{recall_at}", f"NDCG@{recall_at}")]
        table_rows = []
        for name in ["target", *methods]:
            mine = [r for r in rows if r["mode"] == mode and r["drafter"] == name]
            if not mine:
                continue
            row: dict = {c: "-" for c, _ in cols}
            row["method"] = "Target (no SD)" if name == "target" else name
            for r in mine:
                if name != "target":
                    row[f"WS@{r['k']}"], row[f"AS@{r['k']}"] = r["WS"], r["AS"]
                    row[f"calls@{r['k']}"] = r["target_calls"]
                else:
                    for k in ks:
                        row[f"calls@{k}"] = r["plain_calls"]
            at = [r for r in mine if f"recall@{recall_at}" in r]
            if at and (mode == "relaxed" or name == "target"):
                best = min(at, key=lambda r: r["k"])  # the smallest K >= recall_at
                row[f"recall@{recall_at}"] = best[f"recall@{recall_at}"]
                row[f"ndcg@{recall_at}"] = best[f"ndcg@{recall_at}"]
            table_rows.append(row)
        title = "Strict top-K verification" if mode == "strict" else "Relaxed sampling verification"
        out.append(f"### {title}\n\n" + markdown_table(table_rows, cols))
    return "\n\n".join(out)


def run(args: argparse.Namespace) -> dict:
    from training.drafters.api import load_drafter, load_setup, measure_acceptance, pick_users

    ks = parse_int_list(args.k, "--k")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    modes = ["strict", "relaxed"] if modes == ["both"] else modes
    if not methods:
        raise UserError("--methods is empty")
    if any(m not in ("strict", "relaxed") for m in modes) or not modes:
        raise UserError(f"--modes takes strict and/or relaxed, got {args.modes!r}")
    if not 1 <= args.gamma <= 5 or args.n_mult <= 0:
        raise UserError("--gamma must lie in 1..5 and --n-mult be > 0")
    if args.draft_beams is not None and not 1 <= args.draft_beams <= 256:
        raise UserError(f"--draft-beams must lie in 1..256, got {args.draft_beams}")
    set_threads(args.threads)
    setup = load_setup(args.bundle, args.dtype, args.data, attention=args.attention)
    drafters = {m: load_drafter(setup, m) for m in methods}  # every drafter loads before any timing starts
    users = pick_users(setup, args.split, args.users, args.seed)
    rows = measure_acceptance(setup, drafters, users, ks, modes, n_mult=args.n_mult, gamma=args.gamma,
                              temperature=args.temperature, draft_beams=args.draft_beams)
    table = tables(rows, methods, ks, modes)
    print(table)
    payload = {"bench": "drafters", "bundle": str(args.bundle), "methods": methods, "ks": ks, "modes": modes,
               "users": len(users), "user_ids": [u.user_id for u in users], "split": args.split,
               "gamma": args.gamma, "n_mult": args.n_mult,
               "draft_beams": args.draft_beams, "temperature": args.temperature,
               "dtype": resolve_dtype(args.dtype), "attention": args.attention,
               "machine": machine(), "rows": rows, "table": table}
    write_json(args.json_path, payload)
    return payload
