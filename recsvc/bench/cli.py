"""`recsvc bench decode|speculative|serve|drafters|seeds|fuzz`: benchmarks are commands, not timed tests
(BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import importlib

from recsvc.errors import UserError

BENCHES = {
    "decode": ("recsvc.bench.decode", "engine beam search vs transformers generate (same model, same users)"),
    "cache": ("recsvc.bench.cache", "previous forward vs fast forward vs a returning user's cached state, one run: "
              "ms/request, forwards/request, fixed ms per forward, identical outputs"),
    "replay": ("recsvc.bench.replay", "a split's test period replayed against recsvc serve + redis-server (R Recommend "
               "calls before each RecordInteractions): p50 / p99, throughput, state-cache hit rate, RSS"),
    "speculative": ("recsvc.bench.speculative", "plain vs speculative beam search: WS@K, AS@K, target calls"),
    "serve": ("recsvc.bench.serve", "load test of the gRPC service: throughput, latency percentiles"),
    "processes": ("recsvc.bench.processes", "recsvc serve --processes N as a subprocess under load, per N: "
                  "req/s, latency, per-worker requests, CPU; the N=2 vs N=1 ratio"),
    "drafters": ("training.drafter_bench", "drafter alignment methods: WS@K, AS@K strict + relaxed (Table 1)"),
    "seeds": ("recsvc.bench.seeds", "drafter methods across training seeds: mean, spread, paired 95%% CI"),
    "prefix": ("recsvc.bench.prefix", "beam width contract: every top-k is the head of the top-B (counts)"),
    "rules": ("recsvc.bench.rules", "list-level rules (caps, allow-lists): compliance, exactly-K, Recall / NDCG, "
              "ms per strategy"),
    "gpu": ("recsvc.bench.gpu", "build a bundle (base target, llama-68m drafter, draft head) and benchmark the engine "
            "on a GPU: decode vs generate, speculative, relaxed, batched (--smoke: tiny, on the CPU)"),
    "catalog": ("recsvc.bench.catalog", "a large live-catalog file offered to a server under load: latency against "
                "the same load without it, the file's outcome and reason"),
    "gpu-accept": ("recsvc.bench.gpu_accept", "the GPU acceptance figures in one <= 7 minute script (make gpu-bench): "
                   "smoke first; bf16 base target, K 10 of width 20: plain vs generate, strict / relaxed with the "
                   "AtSpeed-aligned llama-68m drafter, 16 batched vs one at a time, host reads per strict round"),
    "fuzz": ("recsvc.bench.fuzz", "generated bad requests against a real server: status codes, no INTERNAL"),
    "failover": ("recsvc.bench.failover", "Redis Cluster failover drill: a master killed under load, errors, "
                 "recovery, acknowledged writes lost"),
}


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (results go to BENCHMARKS.md)")
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module_name, text) in BENCHES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue
            raise
        bp = sub.add_parser(name, help=text)
        module.add_args(bp)
        bp.set_defaults(func=_runner(module))


def _runner(module):
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "users", 1) is not None and getattr(args, "users", 1) < 1:
            raise UserError("--users must be >= 1")
        module.run(args)
        return 0

    return run
