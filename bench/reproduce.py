"""`recsvc bench reproduce`: the served recipe run by a past commit's code and by this tree's, the same command
lines and seed, and their records compared leaf by leaf.

The recipe became code (``training/recipe``) after the commit ``BASELINE``, whose Makefile ran the same command
lines (``tests/test_recipe_stages.py`` holds the recipe's lines equal to the Makefile's). This bench answers
whether the code behind those lines still computes what it did: it exports ``--against`` (default ``BASELINE``)
with ``git archive`` into ``OUT/src``, then runs each selected stage's commands twice, side by side (one process
per side, ``--threads`` torch threads each): with ``PYTHONPATH`` on the exported tree (``OUT/old/bundle``) and on
this tree (``OUT/new/bundle``). Two later changes of what the recipe computes are switched back on this tree's
side only (``RESTORE``): the fused AdamW (``--optimizer foreach``) and the re-scored tuning trials
(``--full-decode``). Then BUNDLE/target/training.json (per-epoch validation figures, the chosen epoch) and
BUNDLE/bundle.json (every tuned choice) and BUNDLE/target/dense_head.json are flattened and compared: timings and
paths are left out, keys only one side writes are listed apart; every weight file (``*.safetensors``) is compared
byte for byte.

    recsvc bench reproduce --data data/beauty --ids artifacts/beauty/ids/semantic_ids.json \\
        --out artifacts/reproduce --set target.epochs=1 target.fit_budget=false target.max_minutes=none \\
        --json artifacts/reproduce/compare.json

A stage whose two sides finished is skipped on a re-run (``OUT/SIDE/done/STAGE``), so a stopped run resumes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

from recsvc.errors import UserError

HELP = "the recipe under a past commit's code and this tree's, same command lines and seed: what differs"
BASELINE = "cd728cc6829c5b6d8dd97b468d25e45ac100ca21"  # the recipe in the Makefile, before training/recipe
# this tree's switches back to what the baseline computed (each a recipe override)
RESTORE = ("target.optimizer=foreach", "prior.full_decode=true", "prior-excl.full_decode=true",
           "mix.full_decode=true", "mix-excl.full_decode=true")
RECORDS = ("target/training.json", "bundle.json", "target/dense_head.json")
# leaves that measure the run rather than the result: wall time, throughput, dates, the budget probe's timing
VOLATILE = re.compile(r"(seconds|_s$|tokens_per_s|finished_at|started_at|minutes_used|other_cores|elapsed|"
                      r"budget_plan|per_trial|this_run|^recipe\.)")
SIDES = ("old", "new")
# -P: the working directory is not put first on sys.path (it may be a recsvc checkout), so PYTHONPATH picks the code
PYTHON_FLAGS = ("-P",)
ROOT = Path(__file__).resolve().parents[1]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--against", default=BASELINE, help="the commit whose code runs the old side (default: the "
                   "last one whose recipe lived in the Makefile)")
    p.add_argument("--data", type=Path, required=True, help="split data directory")
    p.add_argument("--ids", type=Path, required=True, help="semantic_ids.json both sides build on")
    p.add_argument("--out", type=Path, required=True, help="OUT/src, OUT/old/bundle, OUT/new/bundle")
    p.add_argument("--set", dest="settings", nargs="*", default=[], metavar="[STAGE.]FIELD=VALUE",
                   help="recipe overrides applied to both sides (as recsvc build --recipe --set)")
    p.add_argument("--from", dest="first", default="target", help="first stage (default: target)")
    p.add_argument("--to", dest="last", default=None, help="last stage (default: the recipe's last)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per side (both sides run at once)")
    p.add_argument("--no-restore", action="store_true",
                   help="run this tree's side without RESTORE (two commits that compute alike)")
    p.add_argument("--json", dest="json_path", type=Path)


def side_stages(settings: list[str], first: str | None, last: str | None, threads: int,
                restore: bool = True) -> dict[str, list]:
    """The stages each side runs: the served recipe's ``first``..``last`` with ``settings`` and ``threads``, and
    on the new side ``RESTORE`` too (overrides naming a stage outside the range are dropped)."""
    from training.recipe.recipes import override, recipe, select

    stages = select(override(recipe("served"), [*settings, f"threads={threads}"]), first, last)
    names = {s.name for s in stages}
    restore = [r for r in RESTORE if r.split(".", 1)[0] in names] if restore else []
    return {"old": stages, "new": override(stages, restore)}


def export_tree(commit: str, dest: Path) -> Path:
    """``commit``'s files under ``dest`` (``git archive``; kept and reused when ``dest/.commit`` names it)."""
    stamp = dest / ".commit"
    if stamp.is_file() and stamp.read_text().strip() == commit:
        return dest
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], check=True,
                                 capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise UserError(f"--against {commit}: cannot export it from {ROOT} (a git clone of recsvc is needed): "
                        f"{getattr(exc, 'stderr', b'').decode(errors='replace').strip() or exc}") from exc
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    stamp.write_text(commit + "\n")
    return dest


def _run_side(lines: list[list[str]], src: Path, threads: int, log: Path, result: dict[str, int]) -> None:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
    with log.open("a") as f:
        for argv in lines:
            f.write("$ recsvc " + " ".join(argv) + "\n")
            f.flush()
            rc = subprocess.run([sys.executable, *PYTHON_FLAGS, "-m", "recsvc.cli.main", *argv], env=env, stdout=f,
                                stderr=subprocess.STDOUT).returncode
            if rc != 0:
                result["rc"] = rc
                return
    result["rc"] = 0


def code_root(src: Path) -> Path:
    """The directory a side's ``recsvc`` package is imported from (what PYTHONPATH=src runs)."""
    found = subprocess.run([sys.executable, *PYTHON_FLAGS, "-c", "import recsvc; print(recsvc.__file__)"],
                           env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, check=True)
    return Path(found.stdout.strip()).parents[1]


def run_stages(stages: dict[str, list], out: Path, srcs: dict[str, Path], data: Path, ids: Path,
               threads: int) -> None:
    """Each stage on both sides at once (one process each), then the next; finished stages are skipped."""
    from training.recipe.stages import RecipePaths

    for i, name in enumerate(s.name for s in stages["old"]):
        done = {side: out / side / "done" / name for side in SIDES}
        if all(d.is_file() for d in done.values()):
            print(f"[reproduce] {name}: done on both sides, kept", flush=True)
            continue
        print(f"[reproduce] {name}: running on both sides", flush=True)
        results: dict[str, dict[str, int]] = {side: {} for side in SIDES}
        workers = []
        for side in SIDES:
            paths = RecipePaths(data=data, bundle=out / side / "bundle", ids=ids)
            lines = [[c.name, *c.argv] for c in stages[side][i].commands(paths)]
            (out / side / "done").mkdir(parents=True, exist_ok=True)
            w = threading.Thread(target=_run_side, args=(lines, srcs[side], threads, out / side / "log.txt",
                                                         results[side]))
            w.start()
            workers.append(w)
        for w in workers:
            w.join()
        failed = [side for side in SIDES if results[side].get("rc") != 0]
        if failed:
            raise UserError(f"stage {name} failed on the {' and '.join(failed)} side: see "
                            + ", ".join(str(out / s / "log.txt") for s in failed))
        for d in done.values():
            d.write_text("done\n")


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.0": leaf}`` for every leaf of a JSON value."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, list):
        out = {}
        for j, v in enumerate(value):
            out.update(flatten(v, f"{prefix}{j}."))
        return out
    return {prefix[:-1]: value}


def compare(old: dict[str, Any], new: dict[str, Any], old_root: str, new_root: str) -> dict[str, Any]:
    """The leaves of two records: equal, differing (old, new), and on one side only; volatile leaves (timings,
    dates) are left out and each side's bundle path reads BUNDLE."""
    def clean(record: dict[str, Any], root: str) -> dict[str, Any]:
        leaves = {}
        for k, v in flatten(record).items():
            if VOLATILE.search(k):
                continue
            leaves[k] = v.replace(root, "BUNDLE") if isinstance(v, str) else v
        return leaves

    a, b = clean(old, old_root), clean(new, new_root)
    common = sorted(a.keys() & b.keys())
    differ = {k: [a[k], b[k]] for k in common if a[k] != b[k]}
    return {"equal": len(common) - len(differ), "differ": differ, "old_only": sorted(a.keys() - b.keys()),
            "new_only": sorted(b.keys() - a.keys())}


def weight_files(old: Path, new: Path) -> dict[str, str]:
    """Each ``*.safetensors`` under either bundle (checkpoints left out): identical (bytes), differ, or on one
    side only."""
    def found(root: Path) -> dict[str, Path]:
        return {str(f.relative_to(root)): f for f in root.rglob("*.safetensors") if "checkpoints" not in f.parts}

    a, b = found(old), found(new)
    out = {}
    for rel in sorted(a.keys() | b.keys()):
        if rel not in a or rel not in b:
            out[rel] = "old only" if rel in a else "new only"
        else:
            out[rel] = "identical" if a[rel].read_bytes() == b[rel].read_bytes() else "differ"
    return out


def epochs_table(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per epoch, each side's validation Recall@10 / NDCG@10 (BUNDLE/target/training.json "history")."""
    rows: dict[float, dict[str, Any]] = {}
    for side in SIDES:
        for h in records[side].get("target/training.json", {}).get("history", []):
            row = rows.setdefault(h.get("epoch"), {"epoch": h.get("epoch")})
            row[f"{side}_recall@10"] = h.get("recall@10")
            row[f"{side}_ndcg@10"] = h.get("ndcg@10")
    return [rows[e] for e in sorted(rows, key=lambda e: (e is None, e))]


def run(args: argparse.Namespace) -> None:
    from recsvc.report.records import write_json

    if args.threads < 1:
        raise UserError("--threads must be >= 1")
    for path, what in ((args.data, "--data"), (args.ids, "--ids")):
        if not path.exists():
            raise UserError(f"{what} {path}: not found")
    stages = side_stages(args.settings, args.first, args.last, args.threads, restore=not args.no_restore)
    out = args.out.resolve()
    srcs = {"old": export_tree(args.against, out / "src"), "new": ROOT}
    code = {side: code_root(src) for side, src in srcs.items()}
    if code["old"] != srcs["old"].resolve():
        raise UserError(f"the old side would import recsvc from {code['old']}, not {srcs['old']}")
    run_stages(stages, out, srcs, args.data.resolve(), args.ids.resolve(), args.threads)

    records: dict[str, dict[str, Any]] = {side: {} for side in SIDES}
    for side in SIDES:
        for rel in RECORDS:
            path = out / side / "bundle" / rel
            if path.is_file():
                records[side][rel] = json.loads(path.read_text())
    result: dict[str, Any] = {"against": args.against, "settings": args.settings,
                              "restore": [] if args.no_restore else list(RESTORE),
                              "stages": [s.name for s in stages["old"]], "threads": args.threads,
                              "code": {side: str(path) for side, path in code.items()},
                              "epochs": epochs_table(records), "records": {}}
    for rel in RECORDS:
        if rel in records["old"] and rel in records["new"]:
            result["records"][rel] = compare(records["old"][rel], records["new"][rel],
                                             str(out / "old" / "bundle"), str(out / "new" / "bundle"))
    for row in result["epochs"]:
        print(f"epoch {row['epoch']}: validation Recall@10 old {row.get('old_recall@10')} new "
              f"{row.get('new_recall@10')}, NDCG@10 old {row.get('old_ndcg@10')} new {row.get('new_ndcg@10')}",
              flush=True)
    for rel, c in result["records"].items():
        print(f"{rel}: {c['equal']} leaves equal, {len(c['differ'])} differ, {len(c['old_only'])} only in the "
              f"old record, {len(c['new_only'])} only in the new", flush=True)
        for k, (a, b) in list(c["differ"].items())[:20]:
            print(f"  {k}: {a!r} -> {b!r}", flush=True)
    result["weights"] = weight_files(out / "old" / "bundle", out / "new" / "bundle")
    same = sum(v == "identical" for v in result["weights"].values())
    print(f"weights: {same} of {len(result['weights'])} safetensors files byte-identical"
          + "".join(f"; {k} {v}" for k, v in result["weights"].items() if v != "identical"), flush=True)
    result["identical"] = (bool(result["records"]) and all(not c["differ"] for c in result["records"].values())
                           and same == len(result["weights"]))
    print("reproduced: every shared leaf equal, every weight file identical" if result["identical"]
          else "NOT reproduced: leaves or weights differ", flush=True)
    if args.json_path:
        write_json(args.json_path, result)
