"""The load of ``recsvc bench catalog``, in a process of its own (so that the callers never share the server's
GIL): C threads, each with its own channel, sending inline-history PLAIN Recommend calls back to back until a
line (or end of file) arrives on stdin; then one JSON document on stdout: ``{"calls": [[end, ms, code], ...]}``
with ``end`` the wall-clock time (``time.time()``) the answer came.

    python -m bench.catalog_load --target 127.0.0.1:PORT --callers 4 --k 10 --histories H.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import grpc

from bench.processes_load import channel
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.gen import recommender_pb2_grpc as pb_grpc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--callers", type=int, default=4)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--histories", required=True, help="JSON list of histories (lists of item ids)")
    p.add_argument("--timeout-s", type=float, default=30.0)
    args = p.parse_args(argv)
    with open(args.histories) as fh:
        histories: list[list[int]] = json.load(fh)
    stop = threading.Event()
    logs: list[list[tuple[float, float, str]]] = [[] for _ in range(args.callers)]
    channels = [channel(args.target, i) for i in range(args.callers)]
    for ch in channels:
        grpc.channel_ready_future(ch).result(timeout=30)

    def caller(i: int) -> None:
        stub = pb_grpc.RecommenderStub(channels[i])
        n = i
        while not stop.is_set():
            history = histories[n % len(histories)]
            n += args.callers
            request = pb.RecommendRequest(user_id=f"bench-{i}", history=history, k=args.k, mode=pb.PLAIN)
            began = time.perf_counter()
            try:
                stub.Recommend(request, timeout=args.timeout_s)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            logs[i].append((time.time(), (time.perf_counter() - began) * 1000.0, code))

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(args.callers)]
    for t in threads:
        t.start()
    print(json.dumps({"started": time.time()}), flush=True)
    sys.stdin.readline()
    stop.set()
    for t in threads:
        t.join(timeout=args.timeout_s + 5)
    for ch in channels:
        ch.close()
    calls = sorted(c for log in logs for c in log)
    print(json.dumps({"calls": [[round(e, 4), round(ms, 3), code] for e, ms, code in calls]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
