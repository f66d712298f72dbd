"""`recsvc bench gpu`: one command that builds a Beauty bundle and benchmarks the engine on a GPU.

Stages (each resumes: a finished bundle stage is not retrained):
  build   -> ``recsvc build``: the ``base`` target and an SFT ``llama-68m`` drafter (hidden 768, 2 layers, 12
             heads, FFN 3072), each sized to its minutes by ``--fit-budget``; then ``recsvc train head`` (the
             recurrent draft head). About 20 minutes of GPU time in all with the defaults.
  decode  -> engine plain beam search vs transformers ``generate`` (``recsvc bench decode``), K = 1, 5, 10, 20
  spec    -> plain vs strict speculative (``recsvc bench speculative``) with the oracle, the draft head and the
             LLaMA drafter at K = 1, 5, 10, 20: N = 40, gamma 3, and the engine's own autotuned (N, gamma)
  relaxed -> relaxed speculative sampling with the LLaMA drafter
  batched -> plain and strict for a batch of users at once (``BundleRecommender``)
Every stage reports ms per request, WS / AS / target calls where they apply, and the peak GPU memory. Results:
OUT/gpu_bench.json and OUT/gpu_bench.md. The JSON is rewritten after every stage (``"complete": false`` and the
last stage finished), so a run stopped at a time limit keeps what it measured. ``--smoke`` runs the same stages
on the CPU with the tiny presets and a tiny synthetic dataset (``recsvc data synth``) in a few minutes (the test
suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from bench.common import synchronize
from recsvc.errors import UserError
from recsvc.hardware import DEVICES, machine
from recsvc.report.records import markdown_table, write_json
from training.recipe.recipes import SERVED, stage
from training.recipe.runner import run_stage
from training.recipe.stages import RecipePaths, Target, TrainHead

# (target preset, drafter preset, target minutes, drafter epochs, head prefixes, head epochs, users, batch)
FULL = {"preset": "base", "drafter": "llama-68m", "minutes": 12.0, "epochs": 6, "drafter_epochs": 2,
        "prefixes": 4000, "head_epochs": 3, "users": 100, "batch": 16, "ks": "1,5,10,20", "n": 40}
SMOKE = {"preset": "tiny", "drafter": "drafter-tiny", "minutes": 0.5, "epochs": 1, "drafter_epochs": 1,
         "prefixes": 60, "head_epochs": 1, "users": 3, "batch": 3, "ks": "1,5", "n": 6}

# one line of `recsvc bench --help`
HELP = ("build a bundle (base target, llama-68m drafter, draft head) and benchmark the engine on a GPU: decode vs"
        " generate, speculative, relaxed, batched (--smoke: tiny, on the CPU)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="split data directory (Beauty: `recsvc data prepare-amazon`); not with --smoke")
    p.add_argument("--out", default="artifacts/gpu-bench", help="work directory: bundle, JSON, Markdown")
    p.add_argument("--smoke", action="store_true",
                   help="tiny presets on a tiny synthetic dataset, on the CPU: the whole script in a few minutes")
    p.add_argument("--device", choices=("auto", *DEVICES), default="auto", help="auto: cuda when present")
    p.add_argument("--users", type=int, default=None, help="measured users per stage (default 100; smoke 3)")
    p.add_argument("--batch", type=int, default=None, help="users per batch in the batched stage")
    p.add_argument("--target-minutes", type=float, default=None, help="the target's training budget (12)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", dest="json_path", help="default OUT/gpu_bench.json")


def _cli(argv: list[str]) -> None:
    from recsvc.cli.main import main as recsvc_main

    print("$ recsvc " + " ".join(argv), flush=True)
    if recsvc_main(argv) != 0:
        raise UserError(f"`recsvc {' '.join(argv)}` failed")


def build(data: Path, bundle: Path, cfg: dict, threads: int | None) -> None:
    """The bundle through the served recipe's target and head stages (the paper protocol, no dense head, an SFT
    drafter; the head as ``train head`` defaults it: AtSpeed-S at alpha 0.5), resumable: finished stages are
    kept."""
    target, head = stage(SERVED, "target"), stage(SERVED, "head")
    assert isinstance(target, Target) and isinstance(head, TrainHead)
    paths = RecipePaths(data, bundle)
    if not (bundle / "drafter" / "config.json").is_file():
        run_stage(dataclasses.replace(
            target, preset=cfg["preset"], protocol="paper", refit=None, refit_epochs=None, threads=threads,
            max_minutes=cfg["minutes"], fit_budget=True, epochs=cfg["epochs"], dense_head=None,
            drafter_preset=cfg["drafter"], drafter_epochs=cfg["drafter_epochs"], recall_users=64, eval_users=128),
            paths)
    if not (bundle / "head" / "config.json").is_file():
        run_stage(dataclasses.replace(head, method="atspeed-s", alpha=0.5, prefixes=cfg["prefixes"],
                                      epochs=cfg["head_epochs"], threads=threads), paths)


class PeakMemory:
    """Peak GPU memory (MiB) of a stage (None on CPU)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.mib = None
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.mib = torch.cuda.max_memory_allocated() / 2**20


def batched(bundle: Path, device: str, users, k: int, batch: int) -> dict:
    """Plain and strict (the LLaMA drafter, N = K, gamma 3) over batches of users: ms per request, target calls,
    identical-output rate."""
    from recsvc.recommender.api import RecQuery
    from recsvc.recommender.bundle_recommender import BundleRecommender, SpecSettings

    rec = BundleRecommender.from_bundle(bundle, device=device, attention="exact",
                                        drafter_name=str(bundle / "drafter"))
    rec = rec.variant(spec=SpecSettings(draft_beams=k, gamma=3))
    groups = [users[i:i + batch] for i in range(0, len(users), batch)]
    out: dict = {"k": k, "batch": batch, "users": len(users)}
    items: dict[str, list] = {}
    for mode in ("plain", "strict"):
        rec.recommend([RecQuery(history=u.history, k=k, mode=mode) for u in groups[0]])  # warm-up
        ms, calls, got = 0.0, [], []
        for g in groups:
            start = time.perf_counter()
            res = rec.recommend([RecQuery(history=u.history, k=k, mode=mode) for u in g])
            synchronize(device)
            ms += 1000 * (time.perf_counter() - start)
            calls += [r.stats.target_calls for r in res]
            got += [r.item_ids for r in res]
        out[f"{mode}_ms_per_request"] = ms / len(users)
        out[f"{mode}_target_calls"] = statistics.mean(calls)
        items[mode] = got
    out["WS"] = out["plain_ms_per_request"] / out["strict_ms_per_request"]
    out["identical"] = sum(a == b for a, b in zip(items["plain"], items["strict"], strict=True)) / len(users)
    return out


def run(args: argparse.Namespace) -> dict:
    from bench import decode, speculative
    from bench.common import load_context
    from recsvc.cli.args import set_threads

    cfg = dict(SMOKE if args.smoke else FULL)
    if args.users:
        cfg["users"] = args.users
    if args.batch:
        cfg["batch"] = args.batch
    if args.target_minutes:
        cfg["minutes"] = args.target_minutes
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke and args.device == "auto":
        device = "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA GPU (a CPU-only torch build, or no driver)")
    set_threads(args.threads)
    out = Path(args.out)
    data = out / "data" if args.smoke else Path(args.data or "")
    if args.smoke and not (data / "items.json").is_file():
        _cli(["data", "synth", "--out", str(data), "--items", "80", "--users", "160", "--seed", "0"])
    if not args.smoke and not args.data:
        raise UserError("--data DIR is required (a prepared split, e.g. Beauty), or use --smoke")
    bundle = out / "bundle"
    json_path = Path(args.json_path) if args.json_path else out / "gpu_bench.json"
    t0 = time.perf_counter()
    build(data, bundle, cfg, args.threads)
    build_min = (time.perf_counter() - t0) / 60
    common = {"bundle": str(bundle), "users": cfg["users"], "k": cfg["ks"], "split": "test", "dtype": "auto",
              "data": None, "threads": args.threads, "device": device, "json_path": None}
    stages: dict = {"build_minutes": build_min}

    def checkpoint(stage: str) -> None:  # a run stopped at a time limit keeps the stages it finished
        write_json(json_path, {"bench": "gpu", "smoke": args.smoke, "device": device, "machine": machine(),
                               "config": cfg, "stages": stages, "complete": False, "last_stage": stage})

    with PeakMemory(device) as mem:
        res = decode.run(argparse.Namespace(**common, warmup=1, attention="exact", cold=args.smoke))
    stages["decode"] = {"rows": res["rows"], "peak_gpu_mib": mem.mib}
    checkpoint("decode")
    spec_rows = []
    runs = [("oracle", "strict"), ("head", "strict"), ("llama", "strict"), ("llama", "relaxed")]
    for drafter, mode in runs:
        grid = f"{cfg['n']}:3,K/2:1,K/2:3,K:1,K:2,K:3,2K:3" if mode == "strict" else f"{cfg['n']}:3,K:3"
        ns = argparse.Namespace(**common, mode=mode, drafter=drafter, drafter_name=None, head_opener="auto",
                                prior="auto", grid=grid, temperature=1.0, calibration_users=min(4, cfg["users"]),
                                attention="exact")
        with PeakMemory(device) as mem:
            res = speculative.run(ns)
        for row in res["rows"]:
            spec_rows.append({"drafter": drafter, "mode": mode, "peak_gpu_mib": mem.mib, **row})
        stages["speculative"] = spec_rows
        checkpoint(f"speculative {drafter} {mode}")
    ctx = load_context(bundle, cfg["users"], "test", "auto", None, device=device)
    with PeakMemory(device) as mem:
        rows = [batched(bundle, device, ctx.users, k, cfg["batch"]) for k in (int(x) for x in cfg["ks"].split(","))]
    stages["batched"] = [{**r, "peak_gpu_mib": mem.mib} for r in rows]
    md = report(stages, device)
    payload = {"bench": "gpu", "smoke": args.smoke, "device": device, "machine": machine(), "config": cfg,
               "stages": stages, "complete": True, "markdown": md}
    write_json(json_path, payload)
    json_path.with_suffix(".md").write_text(md + "\n")
    print(md)
    return payload


def report(stages: dict, device: str) -> str:
    """The Markdown tables of a run (decode, speculative, batched)."""
    dec = markdown_table(stages["decode"]["rows"], [("k", "K"), ("engine_ms", "engine ms/req"),
                         ("generate_ms", "generate ms/req"), ("speedup", "speedup"), ("identical_rate", "identical")])
    spec = markdown_table([{**r, "mem": r["peak_gpu_mib"] or 0.0, "same": r.get("identical", "-")}
                           for r in stages["speculative"]],
                          [("drafter", "drafter"), ("mode", "mode"), ("k", "K"), ("setting", "setting"), ("N", "N"),
                           ("gamma", "gamma"), ("plain_ms", "plain ms"), ("spec_ms", "spec ms"), ("WS", "WS"),
                           ("AS", "AS"), ("target_calls_spec", "target calls"), ("same", "identical"),
                           ("mem", "peak MiB")])
    bat = markdown_table(stages["batched"], [("k", "K"), ("batch", "batch"), ("plain_ms_per_request", "plain ms/req"),
                                             ("strict_ms_per_request", "strict ms/req"), ("WS", "WS"),
                                             ("strict_target_calls", "target calls (strict)"),
                                             ("identical", "identical")])
    return (f"# recsvc on {device}\n\nbuild: {stages['build_minutes']:.1f} min\n\n## engine vs generate\n\n{dec}\n\n"
            f"## speculative (batch 1)\n\n{spec}\n\n## batched\n\n{bat}")
