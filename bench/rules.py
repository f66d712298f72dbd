"""`recsvc bench rules`: list-level rules on real users, every strategy beside plain decoding without rules.

Scenarios (K items per request, the served engine: BundleRecommender, fused prior, one request at a time):
caps of ``--caps`` items per value of ``--cap-attribute`` (brand m = 1, m = 2), and an allow-list (``--allow``).
Per scenario and strategy (``--strategies``; docs/RULES.md): compliance (lists that satisfy every rule),
exactly-K (lists of K items, among users for whom the catalog holds K compliant items), Recall@K / NDCG@K
against the users' test items (and each strategy's NDCG@K minus the scenario's best, paired per user, with its
standard error: "within noise" is then a number), ms per request and target forward calls per request.
Strategies are timed interleaved, user by user, so load on the machine hits them alike; a second table splits
each strategy's milliseconds by phase (``recsvc.engine.meters.ledger``). ``--lookahead-when always`` forces CDSL's and
CDLH's look-aheads at every depth (default: only where the caps keep extra beams; the same lists).

    recsvc bench rules --bundle artifacts/beauty/bundle --users 200 --k 10 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from recsvc.bundle.loading import PRECISIONS
from recsvc.cli.args import set_threads
from recsvc.data.split import EVAL_SPLITS
from recsvc.engine.meters.ledger import NO_LEDGER, Ledger, PhaseLedger
from recsvc.errors import UserError
from recsvc.hardware import machine
from recsvc.report.records import markdown_table, write_json
from recsvc.rules.attributes import ItemAttributes
from recsvc.rules.spec import LOOKAHEAD_WHEN, STRATEGIES, VERIFY_MODES, Cap, Rules, ValueFilter, normalize_value
from recsvc_base.progress import progress_bar

# list_search's phases (recsvc.rule_decoding.search), then plain beam search's, in the order a request meets them
PHASES = ("compile", "forward", "head", "select", "lookahead", "other")

# one line of `recsvc bench --help`
HELP = "list-level rules (caps, allow-lists): compliance, exactly-K, Recall / NDCG, ms per strategy"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True)
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--cap-attribute", default="brand")
    p.add_argument("--caps", default="1,2", help="m values of the caps (default: %(default)s)")
    p.add_argument("--allow", default="category=skin,makeup",
                   help="ATTRIBUTE=V1,V2: the allow-list scenario ('' for none; default: %(default)s)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--lookahead", type=int, default=0, help="cdsl / cdlh: candidates completed per depth (0: 2B)")
    p.add_argument("--lookahead-when", choices=LOOKAHEAD_WHEN, default="needed",
                   help="cdsl / cdlh: look ahead only where the caps will keep extra beams (needed: the same lists) "
                        "or at every depth (always: the full look-ahead)")
    p.add_argument("--verify", choices=VERIFY_MODES, default="beams",
                   help="cdsl: the target scores the kept beams (beams) or every drafted path (paths)")
    p.add_argument("--corrections", type=int, default=0,
                   help="cdsl --verify paths: target forwards off a drafted path (-1: all)")
    p.add_argument("--factor", type=int, default=4, help="postfilter: beams per item returned")
    p.add_argument("--beam-width", type=int, default=None,
                   help="beams B >= K (default: as served: bundle.json 'beam_width', else 20)")
    p.add_argument("--split", choices=EVAL_SPLITS, default="test")
    p.add_argument("--data", help="data directory (default: the bundle's)")
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="user sample")
    p.add_argument("--json", dest="json_path")


def scenarios(args: argparse.Namespace) -> list[tuple[str, Rules | None]]:
    out: list[tuple[str, Rules | None]] = [("no rules", None)]
    try:
        caps = [int(m) for m in args.caps.split(",") if m.strip()]
    except ValueError:
        raise UserError(f"--caps takes comma-separated integers, got {args.caps!r}") from None
    out += [(f"{args.cap_attribute} m={m}", Rules(caps=(Cap(args.cap_attribute, m),))) for m in caps]
    if args.allow:
        attribute, sep, values = args.allow.partition("=")
        if not sep or not values:
            raise UserError(f"--allow takes ATTRIBUTE=V1,V2, got {args.allow!r}")
        vals = frozenset(normalize_value(v) for v in values.split(",") if v.strip())
        out.append((f"allow {args.allow}", Rules(allow=(ValueFilter(attribute, vals),))))
    return out


def complies(items: Sequence[int], rules: Rules, attrs: ItemAttributes) -> bool:
    """Every filter and cap holds for the list."""
    def vals(attribute: str, item: int) -> set[str]:
        return set(attrs.values.get(attribute, {}).get(item, ()))

    for f in rules.allow:
        if any(not vals(f.attribute, i) & f.values for i in items):
            return False
    for f in rules.deny:
        if any(vals(f.attribute, i) & f.values for i in items):
            return False
    for cap in rules.caps:
        seen: dict[str, int] = {}
        for i in items:
            for v in vals(cap.attribute, i):
                seen[v] = seen.get(v, 0) + 1
        if max(seen.values(), default=0) > cap.m:
            return False
    return True


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    from dataclasses import replace

    from recsvc.bundle.directory import Bundle
    from recsvc.data.metrics import evaluate_rankings, ndcg_at_k, recall_at_k, standard_error
    from recsvc.data.sampling import sample_users
    from recsvc.data.split import load_split_dir
    from recsvc.hardware import resolve_dtype
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender
    from recsvc.rule_decoding.decode import RuleSettings

    set_threads(args.threads)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        RuleSettings(strategy=s)  # UserError for an unknown one
    bundle = Bundle.open(args.bundle)
    width = args.beam_width if args.beam_width is not None else int(bundle.read().get("beam_width", 20))
    rec = BundleRecommender.from_bundle(args.bundle, dtype=args.dtype, beam_width=width)
    catalog = rec.rule_catalog
    if catalog is None:
        raise UserError(f"{args.bundle} has no item attributes: run `recsvc bundle attributes --bundle {args.bundle}`")
    users = sample_users(load_split_dir(bundle.resolve_data_dir(args.data)).eval_users(args.split), args.users,
                         args.seed)
    k = args.k
    base = RuleSettings(lookahead=args.lookahead, lookahead_when=args.lookahead_when, verify=args.verify,
                        corrections=None if args.corrections < 0 else args.corrections, factor=args.factor)
    runs = [(name, rules, s) for name, rules in scenarios(args) for s in (strategies if rules else ["plain"])]

    # one recommender per strategy, built from the loaded one (models shared)
    by_strategy = {s: rec.variant(rules=replace(base, strategy=s)) for s in strategies}

    def once(history: list[int], rules: Rules | None, strategy: str, ledger: Ledger = NO_LEDGER
             ) -> tuple[list[int], float, int]:
        served = by_strategy[strategy] if strategy != "plain" else rec
        start = time.perf_counter()
        (res,) = served.recommend([RecQuery(history=history, k=k, mode="plain", rules=rules)], ledger)
        return res.item_ids, 1000 * (time.perf_counter() - start), res.stats.target_calls

    for u in users[:3]:  # warm-up: every path once
        for _, rules, strategy in runs:
            once(u.history, rules, strategy)
    stats = {(name, s): {"ms": [], "calls": [], "ok": 0, "exact": 0, "feasible": 0, "rank": {}} for name, _, s in runs}
    ledgers = {(name, s): PhaseLedger() for name, _, s in runs}
    for u in progress_bar(users, desc="users"):
        for name, rules, strategy in runs:
            items, ms, calls = once(u.history, rules, strategy, ledgers[(name, strategy)])
            st = stats[(name, strategy)]
            st["ms"].append(ms)
            st["calls"].append(calls)
            st["rank"][u.user_id] = items
            st["ok"] += rules is None or complies(items, rules, catalog.attrs)
            feasible = rules is None or len(rec.popular_items(k, (), rules)) == k
            st["feasible"] += feasible
            st["exact"] += feasible and len(items) == k
    rows = []
    scored = [u for u in users if u.targets]
    per_user = {key: ([recall_at_k(st["rank"][u.user_id], u.targets, k) for u in scored],
                      [ndcg_at_k(st["rank"][u.user_id], u.targets, k) for u in scored]) for key, st in stats.items()}
    for name, _, strategy in runs:
        st = stats[(name, strategy)]
        m = evaluate_rankings(st["rank"], users, [k])
        best = max((s for n, _, s in runs if n == name), key=lambda s: statistics.mean(per_user[(name, s)][1]))
        rows.append({"scenario": name, "strategy": strategy, "compliance": 100.0 * st["ok"] / len(users),
                     "exact_k": 100.0 * st["exact"] / max(st["feasible"], 1), "recall": m[f"recall@{k}"],
                     "ndcg": m[f"ndcg@{k}"], "best": best, "ms": statistics.mean(st["ms"]),
                     "ms_median": statistics.median(st["ms"]), "target_calls": statistics.mean(st["calls"]),
                     "feasible_users": st["feasible"]})
        phases = {ph: ms / len(users) for ph, ms in ledgers[(name, strategy)].ms.items()}
        rows[-1]["phases_ms"] = {**phases, "other": rows[-1]["ms"] - sum(phases.values())}
        for i, metric in enumerate(("recall", "ndcg")):  # paired per user against the scenario's best NDCG
            diff = [a - b for a, b in zip(per_user[(name, strategy)][i], per_user[(name, best)][i], strict=True)]
            rows[-1][f"{metric}_vs_best"] = statistics.mean(diff)
            rows[-1][f"{metric}_vs_best_se"] = standard_error(diff)
        rows[-1]["vs_best"] = f"{rows[-1]['ndcg_vs_best']:+.4f} ± {rows[-1]['ndcg_vs_best_se']:.4f}"
        print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in rows[-1].items()})
    table = markdown_table(rows, [("scenario", "rules"), ("strategy", "strategy"), ("compliance", "compliant %"),
                                  ("exact_k", f"exactly {k} %"), ("recall", f"Recall@{k}"), ("ndcg", f"NDCG@{k}"),
                                  ("vs_best", "NDCG vs the scenario's best (paired, ± SE)"),
                                  ("ms", "ms / request"), ("target_calls", "target calls")])
    print(table)
    phase_names = [ph for ph in PHASES if any(ph in r["phases_ms"] for r in rows)]
    phase_rows = [{"scenario": r["scenario"], "strategy": r["strategy"], "ms": r["ms"],
                   **{ph: r["phases_ms"].get(ph, 0.0) for ph in phase_names}} for r in rows]
    phase_table = markdown_table(phase_rows, [("scenario", "rules"), ("strategy", "strategy"),
                                              ("ms", "ms / request"), *[(ph, ph) for ph in phase_names]])
    print("ms per request per phase (recsvc.engine.meters.ledger; 'other' = the rest of the request):")
    print(phase_table)
    payload = {"bench": "rules", "k": k, "users": len(users), "split": args.split, "beam_width": width,
               "settings": {"lookahead": args.lookahead, "lookahead_when": args.lookahead_when, "verify": args.verify,
                            "corrections": args.corrections,
                            "factor": args.factor},
               "dtype": resolve_dtype(args.dtype), "machine": machine(), "rows": rows, "table": table,
               "phase_table": phase_table}
    write_json(args.json_path, payload)
    return payload
