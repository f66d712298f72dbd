"""`recsvc bench seeds`: drafter methods across training seeds, and how sure a comparison is.

    recsvc bench drafters --bundle B --methods wordkd,wordkd-s1,wordkd-s2,atspeed-r,atspeed-r-s1,... \\
        --modes relaxed --k 10 --users 5000 --json a.json          # (one or several such runs)
    recsvc bench seeds --json a.json,b.json --mode relaxed --k 10 --reference atspeed-r

A drafter named ``M-sN`` is method M trained with ``--seed N``; plain ``M`` is seed 0. The runs must have
measured the same users (``recsvc bench drafters`` stores their ids and each user's accepted depths). Per
method: AS@K of every seed, their mean and range, and the standard error over users of the seed-averaged
per-user acceptance. Against ``--reference``: the paired per-user difference (reference minus method, both
averaged over their seeds) with a 95% interval (1.96 standard errors over users; it covers which users and
which relaxed samples were drawn, not which training seeds, whose spread is the per-seed columns), and how
many (reference seed, method seed) pairs the reference wins or ties.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from recsvc.data.metrics import standard_error
from recsvc.errors import UserError
from recsvc.recommender.api import SPECULATIVE
from recsvc.report.records import markdown_table, write_json

SEED_SUFFIX = re.compile(r"^(?P<method>.+)-s(?P<seed>\d+)$")

# one line of `recsvc bench --help`
HELP = "drafter methods across training seeds: mean, spread, paired 95%% CI"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", dest="inputs", required=True,
                   help="comma-separated JSON files written by `recsvc bench drafters --json`")
    p.add_argument("--mode", choices=SPECULATIVE, default="relaxed")
    p.add_argument("--k", type=int, default=10, help="the K to compare (measured in every file)")
    p.add_argument("--reference", required=True, help="the method the others are compared with (no -sN suffix)")
    p.add_argument("--out", dest="json_path", help="write the summary here (JSON)")


def split_seed(name: str) -> tuple[str, int]:
    """'atspeed-r-a09-s2' -> ('atspeed-r-a09', 2); a name without -sN is seed 0."""
    m = SEED_SUFFIX.match(name)
    return (m["method"], int(m["seed"])) if m else (name, 0)


def collect(payloads: list[dict], mode: str, k: int) -> tuple[list, dict[str, dict[int, list[float]]]]:
    """(user ids, method -> seed -> accepted depth per user) from ``bench drafters`` payloads."""
    users: list | None = None
    setting: tuple | None = None
    groups: dict[str, dict[int, list[float]]] = {}
    for i, p in enumerate(payloads):
        if p.get("bench") != "drafters" or "user_ids" not in p:
            raise UserError(f"input {i + 1} is not a `recsvc bench drafters --json` file with per-user results "
                            "(re-run it with this version)")
        if users is None:
            users = p["user_ids"]
        elif p["user_ids"] != users:
            raise UserError(f"input {i + 1} measured other users than input 1 (same --split/--users/--seed needed)")
        for r in p["rows"]:
            if r["mode"] != mode or r["k"] != k or r["drafter"] == "target":
                continue
            here = (p.get("split"), r["N"], r["gamma"], p.get("temperature"), p.get("dtype"))
            if setting is None:
                setting = here
            elif here != setting:
                raise UserError(f"input {i + 1} used another setting (split, N, gamma, temperature, dtype): "
                                f"{here} vs {setting}")
            method, seed = split_seed(r["drafter"])
            if seed in groups.setdefault(method, {}):
                raise UserError(f"{r['drafter']} ({mode}, K={k}) appears in more than one input")
            groups[method][seed] = [float(a) for a in r["accepted"]]
    if not groups:
        raise UserError(f"no {mode} rows at K={k} in the inputs")
    return users or [], groups


def _mean_per_user(seeds: dict[int, list[float]]) -> list[float]:
    return [statistics.mean(col) for col in zip(*seeds.values(), strict=True)]


def summarize(payloads: list[dict], mode: str, k: int, reference: str) -> dict[str, Any]:
    users, groups = collect(payloads, mode, k)
    if reference not in groups:
        raise UserError(f"--reference {reference!r} is not among the methods: {', '.join(sorted(groups))}")
    seed_as = {m: {s: statistics.mean(a) for s, a in sorted(seeds.items())} for m, seeds in groups.items()}
    ref_user = _mean_per_user(groups[reference])
    out = []
    for method in sorted(groups, key=lambda m: (m != reference, m)):
        seeds, per_seed = groups[method], seed_as[method]
        per_user = _mean_per_user(seeds)
        row: dict[str, Any] = {"method": method, "seeds": sorted(seeds), "AS_per_seed": per_seed,
                               "AS_mean": statistics.mean(per_seed.values()), "AS_min": min(per_seed.values()),
                               "AS_max": max(per_seed.values()), "AS_se_users": standard_error(per_user)}
        if method != reference:
            diff = [a - b for a, b in zip(ref_user, per_user, strict=True)]
            row["diff"] = statistics.mean(diff)
            row["diff_ci95"] = 1.96 * standard_error(diff)
            pairs = [(a, b) for a in seed_as[reference].values() for b in per_seed.values()]
            row["pairs_won"] = sum(a >= b for a, b in pairs)
            row["pairs"] = len(pairs)
        out.append(row)
    return {"bench": "seeds", "mode": mode, "k": k, "users": len(users), "reference": reference, "methods": out}


def verdict(row: dict) -> str:
    """Whether reference >= method, and whether the 95% interval of the difference excludes zero."""
    if "diff" not in row:
        return "reference"
    lo, hi = row["diff"] - row["diff_ci95"], row["diff"] + row["diff_ci95"]
    if lo > 0:
        return "ref > (significant)"
    if hi < 0:
        return "ref < (significant)"
    return "ref >= (within noise)" if row["diff"] >= 0 else "ref < (within noise)"


def table(summary: dict) -> str:
    k = summary["k"]
    cols = [("method", "Method"), ("seeds", "seeds"), ("per_seed", f"AS@{k} per seed"), ("AS_mean", "mean"),
            ("range", "min-max"), ("AS_se_users", "SE (users)"), ("diff", "ref - method"), ("ci", "95% CI"),
            ("won", "seed pairs ref >="), ("verdict", "verdict")]
    rows = []
    for r in summary["methods"]:
        rows.append({"method": r["method"], "seeds": ",".join(map(str, r["seeds"])),
                     "per_seed": " / ".join(f"{v:.3f}" for v in r["AS_per_seed"].values()),
                     "AS_mean": r["AS_mean"], "range": f"{r['AS_min']:.3f}-{r['AS_max']:.3f}",
                     "AS_se_users": r["AS_se_users"],
                     "diff": f"{r['diff']:+.3f}" if "diff" in r else "-",
                     "ci": f"[{r['diff'] - r['diff_ci95']:+.3f}, {r['diff'] + r['diff_ci95']:+.3f}]"
                     if "diff" in r else "-",
                     "won": f"{r['pairs_won']}/{r['pairs']}" if "diff" in r else "-", "verdict": verdict(r)})
    head = (f"{summary['mode']} verification, K = {k}, {summary['users']} users, reference "
            f"{summary['reference']}\n\n")
    return head + markdown_table(rows, cols)


def run(args: argparse.Namespace) -> dict:
    paths = [Path(x.strip()) for x in args.inputs.split(",") if x.strip()]
    if not paths:
        raise UserError("--json is empty")
    payloads = []
    for path in paths:
        try:
            payloads.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
    summary = summarize(payloads, args.mode, args.k, args.reference)
    summary["table"] = table(summary)
    print(summary["table"])
    write_json(args.json_path, summary)
    return summary
