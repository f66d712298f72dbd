"""`recsvc bench train`: the target's training throughput on this machine, and how close it is to the hardware.

Times optimizer steps of a fresh model of each ``--presets`` on the split's training windows (the recipe's
compact prompt and window stride over the bundle's ids and tokenizer), for each precision and optimizer asked for,
and reports per variant: real tokens per second, ms per step, and the model FLOPs it sustains (6 x the
transformer's non-embedding parameters per token, plus the LM head at the positions it runs on). That last figure
against the CPU's peak says what is left to gain: a step that spends most of its time in matrix multiplies at
the core's FMA rate can only go faster with fewer FLOPs or a narrower type (bf16 on AVX512-BF16 / AMX CPUs).
``--profile`` adds each variant's share of time in ``aten::mm`` / ``aten::addmm`` / ``aten::bmm``.

    recsvc bench train --bundle artifacts/beauty/bundle --data data/beauty --threads 1 --steps 30 \\
        --precisions fp32,bf16 --optimizers foreach,fused --json artifacts/beauty/bench/train.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from recsvc.cli.args import set_threads
from recsvc.errors import UserError
from recsvc.hardware import machine, native_bf16
from recsvc.report.records import markdown_table, write_json
from training.choices import OPTIMIZERS

HELP = "target training throughput: tokens/s and sustained FLOPs per preset, precision and optimizer"
PRECISIONS = ("fp32", "bf16")
WARMUP_STEPS = 3
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", required=True, help="a bundle with ids and a tokenizer (its target is not used)")
    p.add_argument("--data", help="the split data directory (default: the bundle's)")
    p.add_argument("--presets", default="small", help="comma-separated model presets (recsvc/bundle/presets.py)")
    p.add_argument("--precisions", default="fp32", help="comma-separated: fp32, bf16 (bf16 autocast)")
    p.add_argument("--optimizers", default="foreach,fused", help="comma-separated AdamW implementations")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (after 3 untimed)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--window-stride", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="also measure each variant's share of time in matmuls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")


@dataclass(frozen=True)
class Variant:
    preset: str
    precision: str
    optimizer: str


def _names(text: str, allowed: tuple[str, ...] | None, flag: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if allowed is not None and n not in allowed]
    if not names or bad:
        raise UserError(f"{flag}: expected a comma-separated list of {', '.join(allowed or ('names',))}, got {text!r}")
    return names


def model_flops_per_token(model, labelled_share: float) -> float:
    """Training FLOPs per token: 6 x the non-embedding parameters (forward 2, backward 4), plus the LM head's
    6 x H x V on the share of positions it runs on."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - emb.numel() - (0 if head is emb else head.numel())
    return 6.0 * body + 6.0 * head.numel() * labelled_share


def run(args: argparse.Namespace) -> dict:
    from recsvc.bundle.directory import Bundle
    from recsvc.bundle.presets import get_preset, new_model
    from recsvc.data.split import load_split_dir
    from training.target_lm.sequences import bucketed_batches, collate, train_examples
    from training.target_lm.train import lm_loss

    set_threads(args.threads)
    if args.steps < 1:
        raise UserError("--steps must be >= 1")
    variants = [Variant(m, p, o) for m in _names(args.presets, None, "--presets")
                for p in _names(args.precisions, PRECISIONS, "--precisions")
                for o in _names(args.optimizers, OPTIMIZERS, "--optimizers")]
    bundle = Bundle.open(args.bundle)
    tok = bundle.load_tokenizer()
    builder = bundle.prompt_builder(tok)
    data_dir = bundle.resolve_data_dir(args.data)
    examples = train_examples(builder, load_split_dir(data_dir).train, stride=args.window_stride)
    if not examples:
        raise UserError(f"{data_dir}: no training windows")
    batches = bucketed_batches([len(e) for e in examples], args.batch_size, seed=args.seed)
    batches = (batches * (1 + (WARMUP_STEPS + args.steps) // len(batches)))[: WARMUP_STEPS + args.steps]
    labelled = sum(sum(1 for x in e.labels if x >= 0) for e in examples) / sum(len(e) for e in examples)

    rows = []
    for v in variants:
        model = new_model(get_preset(v.preset), tok, seed=args.seed)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=v.optimizer == "fused")
        bf16 = v.precision == "bf16"

        def step(idx: list[int], model=model, opt=opt, bf16=bf16) -> int:
            batch = collate([examples[i] for i in idx], tok.pad_token_id)
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _ = lm_loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return int(batch["attention_mask"].sum())

        for idx in batches[:WARMUP_STEPS]:
            step(idx)
        times, tokens = [], 0
        for idx in batches[WARMUP_STEPS:]:
            t0 = time.perf_counter()
            tokens += step(idx)
            times.append(time.perf_counter() - t0)
        seconds = sum(times)
        flops = model_flops_per_token(model, labelled) * tokens / seconds
        row = {"preset": v.preset, "precision": v.precision, "optimizer": v.optimizer,
               "params": sum(p.numel() for p in model.parameters()), "steps": args.steps,
               "tokens_per_s": round(tokens / seconds, 1), "ms_per_step": round(1000 * statistics.mean(times), 2),
               "model_gflops_per_s": round(flops / 1e9, 2), "native_bf16": native_bf16()}
        if args.profile:
            row["matmul_share"] = round(_matmul_share(step, batches[WARMUP_STEPS:WARMUP_STEPS + 5]), 3)
        rows.append(row)
        print(f"{v.preset} {v.precision} {v.optimizer}: {row['tokens_per_s']} tokens/s, "
              f"{row['ms_per_step']} ms/step, {row['model_gflops_per_s']} model GFLOP/s", flush=True)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_first"] = round(row["tokens_per_s"] / base, 3)
    out = {"machine": machine(), "threads": torch.get_num_threads(), "batch_size": args.batch_size,
           "window_stride": args.window_stride, "labelled_share": round(labelled, 3), "rows": rows}
    cols = [("preset", "preset"), ("precision", "precision"), ("optimizer", "optimizer"),
            ("tokens_per_s", "tokens/s"), ("vs_first", "vs first"), ("ms_per_step", "ms/step"),
            ("model_gflops_per_s", "model GFLOP/s")] + ([("matmul_share", "matmul share")] if args.profile else [])
    print(out["machine"])
    print(markdown_table(rows, cols))
    if args.json_path:
        write_json(args.json_path, out)
    return out


def _matmul_share(step, batches: list[list[int]]) -> float:
    """The share of CPU time in matrix multiplies over ``batches`` (torch's profiler, self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for idx in batches:
            step(idx)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    return mm / max(total, 1)
