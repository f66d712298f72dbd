"""`recsvc demo`: the main job on embedded defaults, end to end, in a few minutes on a 2-core CPU.

synthetic catalog + users -> RQ-VAE semantic ids -> tokenizer -> target (small) + drafter (SFT) -> gRPC server
(in-process history store) -> RecordInteractions / Recommend (plain, strict and relaxed speculative) /
GetHistory from a real client over localhost -> printed results and stats -> server stopped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="build a small bundle on synthetic data, serve it, query it")
    p.add_argument("--out", type=Path, default=Path("artifacts/demo"), help="working directory")
    p.add_argument("--items", type=int, default=300)
    p.add_argument("--users", type=int, default=600)
    p.add_argument("--preset", default="small", help="target preset")
    p.add_argument("--drafter-preset", default="drafter-small")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)


def _say(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from recsvc.cli.main import main as recsvc_main

    t0 = time.monotonic()
    data, bundle = args.out / "data", args.out / "bundle"
    if not (data / "items.json").is_file():
        _say(f"synthetic data -> {data}")
        code = recsvc_main(["data", "synth", "--out", str(data), "--items", str(args.items), "--users",
                            str(args.users), "--seed", str(args.seed)])
        if code:
            return code
    _say(f"bundle -> {bundle} (ids, tokenizer, {args.preset} target, {args.drafter_preset} drafter; resumable)")
    code = recsvc_main(["build", "--data", str(data), "--out", str(bundle), "--preset", args.preset,
                        "--epochs", str(args.epochs), "--drafter-preset", args.drafter_preset,
                        "--seed", str(args.seed), "--recall-users", "300", "--eval-users", "500"])
    if code:
        return code
    _serve_and_query(bundle)
    _say(f"demo finished in {time.monotonic() - t0:.0f} s")
    return 0


def _serve_and_query(bundle: Path, startup_budget_s: float = 20.0) -> None:
    from recsvc.client.client import RecClient, response_to_dict
    from recsvc.service.rpc.server import ServerConfig, serve
    from recsvc.service.startup.settings import ServeSettings, build_recommender

    _say("starting the gRPC server as `recsvc serve` would (in-process history store, port chosen by the OS; "
         f"--spec auto calibration within {startup_budget_s:g} s)")
    settings = ServeSettings.for_bundle(str(bundle), ["--startup-budget-s", str(startup_budget_s)])
    rec = build_recommender(settings, step=lambda *a, **f: None)
    server = serve(rec, None, ServerConfig(port=0, default_mode=settings.default_mode))
    try:
        with RecClient(f"127.0.0.1:{server.port}") as client:
            print("health:", client.health())
            items = rec.popular_items(12)
            user = "demo-user-1"
            _say(f"RecordInteractions({user}, {items[:5]})")
            print("history length:", client.record(user, items[:5]))
            for mode in ("plain", "strict", "relaxed"):
                _say(f"Recommend({user}, k=10, mode={mode})")
                resp = client.recommend(user, k=10, mode=mode, seed=7, exclude_history=True)
                out = response_to_dict(resp)
                print(json.dumps({"items": [(i["item_id"], round(i["score"], 3)) for i in out["items"]],
                                  "stats": out.get("stats"), "fallback": out.get("fallback_reason", "")}))
            _say("Recommend(new user without history) -> popular items")
            print(json.dumps(response_to_dict(client.recommend("demo-user-2", k=5))))
            _say(f"GetHistory({user})")
            print(client.history(user))
    finally:
        server.stop(grace_s=2.0)
        print("server stopped")
