"""`recsvc bench fuzz`: many generated bad requests against a real server; counts status codes.

Every request breaks at least one rule (unknown or out-of-range item ids, k out of range, empty / oversized /
control-character user ids, oversized history or exclusions, non-positive or non-finite temperature, unknown
decoding modes, undecodable bytes), over Recommend, RecordInteractions and GetHistory; temperatures include
extreme values (1e-45, 1e-38, 1e-20, above 10). A share of valid requests is sent with tiny deadlines (1-50 ms)
or cancelled by the client after 0-30 ms (``--hostile-share``). The acceptance is zero INTERNAL / UNKNOWN
answers (client side, and in the server's own error counter when it runs in-process) and a server still
serving a valid request at the end.
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from collections import Counter

import grpc

from recsvc.bundle.loading import PRECISIONS
from recsvc.hardware import machine
from recsvc.report.records import write_json

# one line of `recsvc bench --help`
HELP = "generated bad requests against a real server: status codes, no INTERNAL"


def add_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", help="serve this bundle in-process")
    src.add_argument("--target", help="host:port of a running server")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=PRECISIONS, default="auto")
    p.add_argument("--hostile-share", type=float, default=0.1,
                   help="share of valid requests sent with a tiny deadline or cancelled mid-flight")
    p.add_argument("--json", dest="json_path")


def bad_recommend(rng: random.Random, known: list[int], pb) -> object:
    """A RecommendRequest with one or more broken fields (always at least one)."""
    req = pb.RecommendRequest(user_id=f"u{rng.randrange(1000)}", history=rng.sample(known, 3), k=10)
    breaks = rng.sample(range(9), rng.choice([1, 1, 1, 2, 3]))
    for b in breaks:
        if b == 0:
            req.history.append(rng.choice([0, -1, 10**9 + rng.randrange(10**6), 2**63 - 1, -(2**63)]))
        elif b == 1:
            req.k = rng.choice([0, -1, -(2**31), 51, 10**6, 2**31 - 1])
        elif b == 2:
            req.user_id = rng.choice(["", "x" * 129, "tab\tuser", "nul\x00", "\x7f", "y" * 5000])
        elif b == 3:
            req.temperature = rng.choice([0.0, -1.0, float("nan"), float("inf"), -float("inf"), -1e-9,
                                          1e-45, 1e-38, 1e-20, 0.049, 10.5, 1e30])
        elif b == 4:
            req.mode = rng.choice([4, 5, -1, 2**31 - 1, -(2**31)])
        elif b == 5:
            del req.history[:]
            req.history.extend(rng.choices(known, k=rng.choice([201, 500, 5000])))
        elif b == 6:
            req.exclude_items.extend([rng.choice(known)] * rng.choice([1001, 5000]))
        elif b == 7:
            req.history.extend([rng.choice(known), -rng.randrange(1, 10**6)])
        else:
            req.k = 0
            req.temperature = float("nan")
    return req


def hostile_call(rng: random.Random, stub, request) -> str:
    """A valid Recommend with a 1-50 ms deadline, or cancelled by the client after 0-30 ms; the status name."""
    if rng.random() < 0.5:
        try:
            stub.Recommend(request, timeout=rng.uniform(0.001, 0.05))
        except grpc.RpcError as exc:
            return exc.code().name
        return "OK"
    call = stub.Recommend.future(request, timeout=30)
    time.sleep(rng.uniform(0.0, 0.03))
    call.cancel()
    try:
        call.result()
    except grpc.FutureCancelledError:
        return "CANCELLED"
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def run(args: argparse.Namespace) -> dict:
    from recsvc.client.client import RecClient
    from recsvc.errors import UserError
    from recsvc.service.gen import recommender_pb2 as pb

    if args.requests < 1 or args.concurrency < 1:
        raise UserError("--requests and --concurrency must be >= 1")
    hostile_share = getattr(args, "hostile_share", 0.0)
    if not 0.0 <= hostile_share <= 1.0:
        raise UserError(f"--hostile-share must be between 0 and 1, got {hostile_share}")
    server = None
    if args.bundle:
        from recsvc.recommender.bundle_recommender import BundleRecommender
        from recsvc.service.rpc.server import ServerConfig, serve

        rec = BundleRecommender.from_bundle(args.bundle, dtype=args.dtype)  # fp32 attention: the serving default
        server = serve(rec, None, ServerConfig(port=0))
        target, known = f"127.0.0.1:{server.port}", rec.popular_items(500)
    else:
        target, known = args.target, list(range(1, 501))
    codes: Counter[str] = Counter()
    lock = threading.Lock()
    per_thread = math.ceil(args.requests / args.concurrency)
    start = time.perf_counter()

    def worker(tid: int) -> None:
        rng = random.Random(args.seed * 1000 + tid)
        channel = grpc.insecure_channel(target)
        raw = channel.unary_unary("/recsvc.v1.Recommender/Recommend")  # bytes in, bytes out
        with RecClient(target, timeout_s=30) as client:
            for _ in range(per_thread):
                kind = rng.random()
                if rng.random() < hostile_share:
                    valid = pb.RecommendRequest(user_id=f"h{tid}", history=rng.sample(known, 3),
                                                k=rng.choice([1, 5, 10]), mode=rng.choice([0, 1, 2, 3]))
                    code = hostile_call(rng, client.stub, valid)
                    with lock:
                        codes[code] += 1
                    continue
                try:
                    if kind < 0.8:
                        client.stub.Recommend(bad_recommend(rng, known, pb), timeout=30)
                    elif kind < 0.9:
                        bad = rng.choice([[], [0], [-5], [known[0], 10**12], [known[0]] * 201])
                        client.stub.RecordInteractions(pb.RecordInteractionsRequest(
                            user_id=rng.choice(["", "ok-user", "x" * 200]), item_ids=bad), timeout=30)
                    elif kind < 0.95:
                        client.stub.GetHistory(pb.GetHistoryRequest(user_id=rng.choice(["", "x" * 300, "\x01"])),
                                               timeout=30)
                    else:
                        raw(rng.randbytes(rng.randrange(1, 64)), timeout=30)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                with lock:
                    codes[code] += 1
        channel.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    with RecClient(target, timeout_s=30) as client:  # still serving?
        alive = len(client.recommend("after-fuzz", history=known[:3], k=5, mode="plain").items) == 5
    server_internal = None
    if server is not None:
        server_internal = sum(
            server.metrics.registry.get_sample_value("recsvc_errors_total", {"method": m, "code": c}) or 0.0
            for m in ("Recommend", "RecordInteractions", "GetHistory") for c in ("INTERNAL", "UNKNOWN"))
        server.stop(grace_s=1.0)
    total = sum(codes.values())
    payload = {"bench": "fuzz", "requests": total, "codes": dict(codes), "internal_or_unknown":
               codes.get("INTERNAL", 0) + codes.get("UNKNOWN", 0), "server_internal_or_unknown": server_internal,
               "serving_after": alive, "seconds": round(seconds, 1), "machine": machine()}
    print(payload)
    write_json(args.json_path, payload)
    return payload
