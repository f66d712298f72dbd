"""The closed-loop load of ``recsvc bench processes``: C threads, each with its own channel and connection (the
kernel's SO_REUSEPORT spreads connections, not requests, over the workers), sending prebuilt inline-history
Recommend requests back to back with blocking unary calls. Each call is recorded as (end time, latency, code);
the caller picks the measured window afterwards."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.gen import recommender_pb2_grpc as pb_grpc


@dataclass
class ThreadLog:
    """(time.perf_counter() when the answer came, latency ms, status code name) per call."""

    calls: list[tuple[float, float, str]] = field(default_factory=list)


def channel(target: str, index: int) -> grpc.Channel:
    """A channel with a subchannel of its own (no sharing of the process-wide pool): one TCP connection per
    channel, so the kernel places each on a worker independently. No service config: no retries, every error
    is counted as the client saw it."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1),
                                                   ("bench.channel", index)])


def open_channels(target: str, concurrency: int, workers: int, placed_on: Callable[[grpc.Channel], int],
                  balance: bool = True, connect_timeout_s: float = 30.0) -> tuple[list[grpc.Channel], list[int]]:
    """``concurrency`` connected channels and the worker each one reached (``placed_on(channel)``: one probe
    call). ``balance``: channels that would put more than their share (C / N, rounded up for C mod N workers) on
    one worker are closed and replaced by new ones, so every worker gets its share of the load; otherwise the
    kernel's placement is kept as it falls."""
    kept: list[grpc.Channel] = []
    placement: list[int] = []
    share, extra = divmod(concurrency, workers)
    try:
        for attempt in range(max(50, 20 * concurrency)):
            if len(kept) == concurrency:
                return kept, placement
            ch = channel(target, attempt)
            grpc.channel_ready_future(ch).result(timeout=connect_timeout_s)
            worker = placed_on(ch)
            count = placement.count(worker)
            over = sum(1 for w in set(placement) if placement.count(w) > share)
            if not balance or count < share or (count == share and over < extra):
                kept.append(ch)
                placement.append(worker)
            else:
                ch.close()
        raise RuntimeError(f"could not place {concurrency} connections evenly over {workers} workers: "
                           f"{sorted(placement)}")
    except BaseException:
        for ch in kept:
            ch.close()
        raise


def drive(channels: list[grpc.Channel], requests: list[pb.RecommendRequest], on_ready: Callable[[], None],
          timeout_s: float = 30.0) -> list[ThreadLog]:
    """One thread per channel, calling back to back until ``on_ready()`` (run on this thread once all threads
    are sending) returns. Thread i starts at request i * len / C and cycles."""
    concurrency = len(channels)
    logs = [ThreadLog() for _ in range(concurrency)]
    ready = threading.Barrier(concurrency + 1)
    stop = threading.Event()

    def worker(i: int) -> None:
        recommend = pb_grpc.RecommenderStub(channels[i]).Recommend
        log, n = logs[i], len(requests)
        j = i * n // concurrency
        ready.wait()
        while not stop.is_set():
            began = time.perf_counter()
            try:
                recommend(requests[j % n], timeout=timeout_s)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            end = time.perf_counter()
            log.calls.append((end, (end - began) * 1000.0, code))
            j += 1

    threads = [threading.Thread(target=worker, args=(i,), name=f"bench-load-{i}", daemon=True)
               for i in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    try:
        on_ready()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout_s + 5)
    return logs


def window(logs: list[ThreadLog], start: float, end: float) -> tuple[list[float], dict[str, int]]:
    """Latencies (ms, sorted) of the calls answered OK within [start, end], and the count of every code."""
    latencies: list[float] = []
    codes: dict[str, int] = {}
    for log in logs:
        for at, ms, code in list(log.calls):
            if start <= at <= end:
                codes[code] = codes.get(code, 0) + 1
                if code == "OK":
                    latencies.append(ms)
    return sorted(latencies), codes


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (the convention of ``recsvc bench serve``); None when empty."""
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q / 100.0 * len(sorted_values) + 0.5) - 1))
    return round(float(sorted_values[index]), 3)
