"""``recsvc tune capacity``: which target size the catalog's data pays for, chosen on validation.

    recsvc tune capacity --data DATA --ids IDS/semantic_ids.json --out DIR --presets small,base --epochs 10

Each preset of ``--presets`` is trained by the served recipe's target stage (training/recipe; the paper protocol:
fitted on the train period; its epoch chosen on every validation user by ``--select within-se``), with the same
ids, schedule, batch, dense head and seed: only the model's size differs. Each later preset is then ranked on
validation beside the first, the reference (``recsvc eval --against``: the same users, history rule and metric
code, paired per user with a 95% bootstrap interval; the model alone: no prior, no fresh slots), with SASRec fitted
on the same train period beside them. A preset replaces the reference only when its NDCG@10 interval against it
lies above 1; the report names that choice, and the recipe's refit and tunings are then run with it (``make
beauty-target PRESET=...``).

Each preset gets the same training budget, ``--preset-minutes``, fitted as the recipe fits its own
(``--max-minutes --fit-budget``: a few timed steps size the schedule to the epochs that fit, at most ``--epochs``),
so a larger model may run fewer epochs; the report says how many each ran. Resumable: a finished build or
evaluation is kept (``DIR/<preset>``, ``DIR/eval_<preset>.json``). ``--budget-minutes`` bounds the whole sweep: a
preset is started only while time is left, and its budget shrinks to what remains.

Written for a GPU (``make gpu-capacity``: the larger presets train in minutes there, with a larger batch); it runs
anywhere, the tests use the tiny presets on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from recsvc.cli.main import run_command
from recsvc.errors import UserError
from training.recipe.recipes import SERVED, stage
from training.recipe.runner import run_stage
from training.recipe.stages import RecipePaths, Target

EVAL_RESERVE_MINUTES = 1.5  # kept back from a build's training cap for its validation ranking


def register_capacity(sub) -> None:
    p = sub.add_parser("capacity", help="train several target presets with one recipe and compare them on "
                                        "validation (paired, against the first)")
    add_args(p)
    p.set_defaults(func=cmd_tune_capacity)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, required=True, help="split data directory")
    p.add_argument("--ids", type=Path, required=True, help="semantic_ids.json shared by every preset")
    p.add_argument("--out", type=Path, required=True, help="work directory: one bundle per preset, the report")
    p.add_argument("--presets", default="small,base",
                   help="comma-separated target presets; the first is the reference the others are compared with")
    p.add_argument("--epochs", type=int, default=10, help="the schedule's epochs, the same for every preset")
    p.add_argument("--preset-minutes", type=float, default=25.0,
                   help="each preset's training budget (the recipe's --max-minutes, with --fit-budget)")
    p.add_argument("--batch-size", type=int, default=None, help="training windows per batch (GPU: larger)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--dense-head", type=float, default=1.0, help="the dense head's loss weight (the recipe's: 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-minutes", type=float, default=60.0, help="wall time of the whole sweep")
    p.add_argument("--baselines", default="sasrec", help="baselines ranked beside the reference ('none': none)")
    p.add_argument("--sasrec-max-minutes", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="default: OUT/capacity.json")


def _presets(text: str) -> list[str]:
    from recsvc.bundle.presets import TARGET_PRESETS

    presets = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in presets if p not in TARGET_PRESETS]
    if len(presets) < 2 or bad or len(set(presets)) != len(presets):
        raise UserError(f"--presets needs two or more distinct target presets of {', '.join(TARGET_PRESETS)}, "
                        f"got {text!r}")
    return presets


def capacity_target(args: argparse.Namespace, preset: str, minutes: float) -> Target:
    """The served recipe's target stage at ``preset`` under the paper protocol (fitted on the train period, no
    refit), with the sweep's schedule, batch, learning rate, dense head, seed and ``minutes`` of budget."""
    served = stage(SERVED, "target")
    assert isinstance(served, Target)
    return dataclasses.replace(served, preset=preset, protocol="paper", refit=None, refit_epochs=None,
                               epochs=args.epochs, seed=args.seed, dense_head=args.dense_head, max_minutes=minutes,
                               fit_budget=True, batch_size=args.batch_size, lr=args.lr, threads=args.threads)


def trained(bundle: Path) -> dict[str, Any]:
    """What the build of one preset recorded: parameters, epochs run, the chosen epoch and its validation score."""
    info = json.loads((bundle / "target" / "training.json").read_text())
    return {"params": info.get("params"), "epochs_run": len(info.get("selection") or []) or info.get("epochs"),
            "schedule_epochs": info.get("schedule_epochs"), "best_epoch": info.get("best_epoch"),
            "valid_recall@10": (info.get("best") or {}).get("value"), "train_seconds": info.get("seconds"),
            "stopped": info.get("stopped"), "budget_plan": info.get("budget_plan"), "selection": info.get("selection")}


def lead_of(report: dict[str, Any], key: str) -> dict[str, float] | None:
    """A / B on every user for ``key`` (e.g. ndcg@10) from an ``eval --against`` JSON."""
    cell = ((report.get("against") or {}).get("lead") or {}).get("all", {}).get(key)
    return {k: cell[k] for k in ("model", "baseline", "ratio", "ratio_lo", "ratio_hi")} if cell else None


def choose(reference: str, rows: dict[str, dict[str, Any]]) -> str:
    """The preset served: the one with the highest validation NDCG@10 among those whose paired NDCG@10 interval
    against the reference lies above 1; else the reference.

        >>> choose("small", {"base": {"ndcg@10": {"ratio": 1.2, "ratio_lo": 1.05}},
        ...                  "medium": {"ndcg@10": {"ratio": 1.3, "ratio_lo": 0.98}}})
        'base'
    """
    better = {p: r["ndcg@10"]["ratio"] for p, r in rows.items() if r.get("ndcg@10") and r["ndcg@10"]["ratio_lo"] > 1}
    return max(better, key=lambda p: better[p]) if better else reference


def cmd_tune_capacity(args: argparse.Namespace) -> int:
    presets = _presets(args.presets)
    if (args.epochs < 1 or args.budget_minutes <= 0 or args.preset_minutes <= 0
            or (args.batch_size is not None and args.batch_size < 1) or (args.lr is not None and args.lr <= 0)):
        raise UserError("--epochs, --batch-size, --lr, --preset-minutes and --budget-minutes must be positive")
    if not args.data.is_dir():
        raise UserError(f"data directory not found: {args.data}")
    if not args.ids.is_file():
        raise UserError(f"semantic ids file not found: {args.ids}")
    start = time.perf_counter()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    json_path = args.json_path or out / "capacity.json"
    report: dict[str, Any] = {"data": str(args.data), "ids": str(args.ids), "presets": presets, "reference": presets[0],
                              "epochs": args.epochs, "preset_minutes": args.preset_minutes,
                              "batch_size": args.batch_size, "lr": args.lr, "dense_head": args.dense_head,
                              "seed": args.seed, "protocol": "paper", "split": "valid", "builds": {}, "against": {},
                              "skipped": []}

    def left() -> float:
        return args.budget_minutes - (time.perf_counter() - start) / 60

    def save() -> None:
        json_path.write_text(json.dumps(report, indent=1, default=float))

    for preset in presets:
        bundle = out / preset
        if not (bundle / "target" / "training.json").is_file():
            if left() < 2 * EVAL_RESERVE_MINUTES:
                report["skipped"].append(preset)
                continue
            t0 = time.perf_counter()
            minutes = max(min(args.preset_minutes, left() - EVAL_RESERVE_MINUTES), 0.5)
            run_stage(capacity_target(args, preset, round(minutes, 2)), RecipePaths(args.data, bundle, args.ids))
            report["builds"][preset] = {"build_minutes": round((time.perf_counter() - t0) / 60, 2)}
        report["builds"].setdefault(preset, {}).update(trained(bundle))
        save()

    reference = out / presets[0]
    if presets[0] in report["skipped"]:
        raise UserError(f"the reference preset {presets[0]} was not trained within --budget-minutes")
    for preset in presets[1:]:
        if preset in report["skipped"]:
            continue
        path = out / f"eval_{preset}.json"
        if not path.is_file():
            run_command("eval", ["--bundle", str(out / preset), "--against", str(reference), "--against-label",
                                presets[0], "--split", "valid", "--protocol", "paper", "--k", "10,20",
                                "--exclude-history", "--no-prior", "--no-fresh", "--baselines", args.baselines,
                                "--cache-dir", str(out / "baselines"), "--sasrec-max-minutes",
                                str(args.sasrec_max_minutes), "--json", str(path)])
        result = json.loads(path.read_text())
        report["against"][preset] = {key: lead_of(result, key) for key in ("recall@10", "ndcg@10", "recall@20")}
        report["against"][preset]["baselines"] = {  # fitted on the train period, ranked on the same users
            name: {k: metrics.get(k) for k in ("recall@10", "ndcg@10")}
            for name, metrics in (result.get("baselines") or {}).items()}
        save()
    report["chosen"] = choose(presets[0], report["against"])
    report["minutes"] = round((time.perf_counter() - start) / 60, 2)
    save()
    for preset in presets:
        b = report["builds"].get(preset)
        if b is None:
            print(f"{preset}: skipped (budget)")
            continue
        line = (f"{preset}: {b['params'] / 1e6:.1f}M params, {b['epochs_run']} of {args.epochs} epochs, epoch "
                f"{b['best_epoch']} chosen (validation Recall@10 {b['valid_recall@10']:.4f})")
        a = report["against"].get(preset)
        if a and a["ndcg@10"]:
            line += "; against " + presets[0] + ": " + ", ".join(
                f"{k} {a[k]['model']:.4f} vs {a[k]['baseline']:.4f}, {a[k]['ratio']:.3f}x "
                f"[{a[k]['ratio_lo']:.3f}, {a[k]['ratio_hi']:.3f}]" for k in ("recall@10", "ndcg@10") if a.get(k))
        print(line)
    for name, m in next((a["baselines"] for a in report["against"].values() if a.get("baselines")), {}).items():
        if m.get("recall@10") is not None:
            print(f"{name} (fitted on the train period, the same users): Recall@10 {m['recall@10']:.4f}, NDCG@10 "
                  f"{m['ndcg@10']:.4f}")
    print(f"capacity: {report['chosen']} (a preset replaces {presets[0]} only when its NDCG@10 interval lies above 1)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m training.tuning.capacity ...`` (a GPU image without the console script)."""
    p = argparse.ArgumentParser(prog="python -m training.tuning.capacity")
    add_args(p)
    try:
        return cmd_tune_capacity(p.parse_args(argv))
    except UserError as exc:
        print(f"error: {exc}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
