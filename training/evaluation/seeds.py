"""`recsvc eval summarize s0.json s1.json s2.json [--json out]`: several evaluations of one protocol (e.g. the recipe
built with three training seeds) read as one figure per comparison.

For each comparison the runs share (``"paired"`` in each file: the served lists or the model without slots
against a baseline, or ``--against``) and each slice and key (``"recall@10"``, ...):
- each run's ratio of means with its own 95% paired interval (as ``recsvc eval`` printed it);
- the mean of the runs' ratios, with a 95% interval from resampling the users jointly
  (``training.evaluation.lead.mean_ratio``): each of 2,000 resamples draws the test users once with replacement,
  computes every run's ratio on that draw from the per-user scores the files keep (``"per_user"``), and takes their
  mean; the interval is the 2.5% and 97.5% percentiles. The runs ranked the same users, so their errors move together
  and the draw must be shared (a bootstrap that drew users for each run apart would narrow the interval as if
  three times as many users had been tested). The interval covers which users were drawn, not which seeds were
  trained: the seeds' spread is the per-run column.

Files of different splits, protocols, fitting periods, history rules, cutoffs, targets or user sets are refused
(exit 2): their ratios are not of one quantity.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recsvc.errors import UserError

# what must agree between the runs for their ratios to be of one quantity
IDENTITY = ("split", "protocol", "fit_on", "exclude_history", "ks", "target", "users")
RUN_FIELDS = ("ratio", "ratio_lo", "ratio_hi", "model", "baseline")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summarize", help="the mean over several `recsvc eval --json` runs (e.g. training seeds) of "
                                         "each ratio, with a joint bootstrap interval over the users")
    p.add_argument("files", nargs="+", metavar="EVAL_JSON", help="files written by `recsvc eval --json` (2 or more)")
    p.add_argument("--json", dest="json_path", help="write the summary here")
    p.add_argument("--resamples", type=int, default=2000,
                   help="bootstrap resamples of the users (default: %(default)s)")
    p.set_defaults(func=cmd_summarize)


def load_run(path: str) -> dict[str, Any]:
    """An eval JSON with its paired comparisons and per-user scores, or a UserError naming what is missing."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{file}: no such file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{file}: not a JSON file ({exc})") from None
    if not isinstance(data, dict) or "paired" not in data or "per_user" not in data:
        raise UserError(f"{file}: not a `recsvc eval --json` file with paired per-user scores ('paired', "
                        "'per_user'): evaluate again with this version")
    return data


def check_same(paths: Sequence[str], runs: Sequence[Mapping[str, Any]]) -> None:
    """Refuse runs whose split, protocol, fitting period, history rule, cutoffs, target or users differ."""
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:], strict=True):
        for key in IDENTITY:
            if run.get(key) != first.get(key):
                raise UserError(f"{path}: {key} is {run.get(key)!r} where {paths[0]} has {first.get(key)!r}: "
                                "summarize runs of one split, protocol and user set")
        if run["per_user"]["users"] != first["per_user"]["users"]:
            raise UserError(f"{path}: other users (or other cold / warm slices) than {paths[0]}: summarize runs "
                            "over the same users and catalog")


def summarize(paths: Sequence[str], runs: Sequence[Mapping[str, Any]], resamples: int = 2000) -> dict[str, Any]:
    """The summary (see the module's docstring) of runs that passed ``check_same``."""
    from training.evaluation.lead import mean_ratio
    from training.evaluation.paired import find_pair, scores_from_payload

    keyed = [(r["model"], r["baseline"]) for r in runs[0]["paired"]]
    shared = [p for p in keyed if all(find_pair(run["paired"], *p) is not None for run in runs)]
    per_user = [{m: scores_from_payload(run["per_user"], m) for m in {x for p in shared for x in p}} for run in runs]
    pairs = []
    for model, baseline in shared:
        own = [find_pair(run["paired"], model, baseline) for run in runs]
        slices: dict[str, dict[str, Any]] = {}
        for part, keys in own[0]["slices"].items():
            slices[part] = {}
            for key in keys:
                arrays = [(s[model][part][key], s[baseline][part][key]) for s in per_user]
                slices[part][key] = {"mean": mean_ratio(arrays, resamples),
                                     "runs": [{f: r["slices"][part][key].get(f) for f in RUN_FIELDS} for r in own]}
        pairs.append({"model": model, "baseline": baseline, "slices": slices})
    dropped = [p for p in keyed if p not in shared]
    return {"runs": list(paths), "identity": {key: runs[0].get(key) for key in IDENTITY},
            "labels": [_label(run) for run in runs], "pairs": pairs, "not_in_every_run": dropped,
            "headline": _headline(runs, pairs), "resamples": resamples}


def _label(run: Mapping[str, Any]) -> dict[str, Any]:
    against = run.get("against") or {}
    return {"machine": run.get("machine"), "dtype": run.get("dtype"), "against": against.get("label")}


def _headline(runs: Sequence[Mapping[str, Any]], pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The runs' headline comparisons (those of the first file) averaged, and the cold slice's figures per run."""
    h = runs[0].get("headline")
    if not h:
        return None
    k = h["k"]
    out: dict[str, Any] = {"k": k, "baseline": h["baseline"]}
    for name in ("served_vs_baseline", "own_vs_baseline_warm"):
        ref = h.get(name)
        rec = ref and next((p for p in pairs if p["model"] == ref["model"] and p["baseline"] == ref["baseline"]), None)
        out[name] = ({"model": ref["model"], "baseline": ref["baseline"], "slice": ref["slice"],
                      **{m: rec["slices"][ref["slice"]][f"{m}@{k}"] for m in ("recall", "ndcg")}}
                     if ref and rec else None)
    colds = [run["headline"]["cold"] for run in runs]
    out["cold"] = {"users": colds[0]["users"],
                   **{f"{w}_{m}": {"mean": sum(c[f"{w}_{m}"] for c in colds) / len(colds),
                                   "runs": [c[f"{w}_{m}"] for c in colds]}
                      for w in ("own", "served") for m in ("recall", "ndcg")}}
    return out


def _cell(entry: Mapping[str, Any]) -> str:
    mean = entry["mean"]
    runs = ", ".join(f"{r['ratio']:.3f}" if r.get("ratio") is not None else "-" for r in entry["runs"])
    if mean.get("ratio") is None or mean.get("ratio_lo") is None:
        return f"- (runs: {runs})"
    return f"{mean['ratio']:.3f}x [{mean['ratio_lo']:.3f}, {mean['ratio_hi']:.3f}] (runs: {runs})"


def format_summary(summary: Mapping[str, Any]) -> str:
    from training.evaluation.headline import headline_k

    h = summary["headline"]
    ident = summary["identity"]
    k = headline_k(list(ident["ks"]))
    lines = [f"{len(summary['runs'])} runs, {ident['split']} split, {int(ident['users'])} users, protocol "
             f"{ident['protocol']}, history items {'excluded' if ident['exclude_history'] else 'kept'}: the mean of "
             "the runs' ratios with a 95% interval from resampling the users jointly (each run's ratio in brackets)"]
    if h:
        for name, what in (("served_vs_baseline", "served lists vs {b}"),
                           ("own_vs_baseline_warm", "the model without slots vs {b}, warm slice")):
            r = h.get(name)
            if r:
                lines.append(f"- {what.format(b=r['baseline'])}: Recall@{k} {_cell(r['recall'])}; "
                             f"NDCG@{k} {_cell(r['ndcg'])}")
        cold = h["cold"]
        lines.append(f"- cold slice ({int(cold['users'])} users), Recall@{k}: the model's own lists "
                     f"{_mean_runs(cold['own_recall'])}, served {_mean_runs(cold['served_recall'])}")
    lines += [f"| every user | Recall@{k} | NDCG@{k} |", "| --- | --- | --- |"]
    for p in summary["pairs"]:
        cells = p["slices"]["all"]
        lines.append(f"| {p['model']} vs {p['baseline']} | {_cell(cells[f'recall@{k}'])} | "
                     f"{_cell(cells[f'ndcg@{k}'])} |")
    if summary["not_in_every_run"]:
        lines.append("not in every run (left out): " + ", ".join(f"{a} vs {b}" for a, b in summary["not_in_every_run"]))
    return "\n".join(lines)


def _mean_runs(entry: Mapping[str, Any]) -> str:
    return f"{entry['mean']:.4f} (runs: " + ", ".join(f"{x:.4f}" for x in entry["runs"]) + ")"


def cmd_summarize(args: argparse.Namespace) -> int:
    if len(args.files) < 2:
        raise UserError("summarize needs 2 or more eval JSON files")
    if args.resamples < 1:
        raise UserError("--resamples must be >= 1")
    runs = [load_run(path) for path in args.files]
    check_same(args.files, runs)
    summary = summarize(args.files, runs, args.resamples)
    print(format_summary(summary))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(summary, indent=1))
    return 0
