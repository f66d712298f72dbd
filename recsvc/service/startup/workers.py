"""``recsvc serve --processes N``: a parent that binds nothing spawns N serving processes sharing the port
(SO_REUSEPORT), forwards signals to them and exits when all have exited."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from recsvc.errors import UserError
from recsvc.service.observability.logs import log_step

from .process import serve_one


def worker_main(args: argparse.Namespace, index: int) -> None:
    """A ``--processes N`` worker (spawned: a fresh interpreter, no inherited grpc or torch state)."""
    args.processes = 1
    args.worker_index = index
    if getattr(args, "threads", None) is None:
        args.threads = 1  # N workers on N cores: one intra-op thread each, no oversubscription
    parent = os.getppid()

    def watch_parent() -> None:  # the parent killed (SIGKILL, OOM): drain and exit rather than linger
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, name="recsvc-parent-watch", daemon=True).start()
    if args.metrics_port:
        args.metrics_port += index
    try:
        serve_one(args)
    except UserError as exc:
        print(f"error: worker {index}: {exc}", file=sys.stderr, flush=True)
        os._exit(2)


def run_workers(args: argparse.Namespace) -> int:
    """``--processes N``: the pattern of grpc's examples/python/multiprocessing. The parent binds nothing (it
    only checks that the port is free), spawns N workers, each with its own engine and gRPC server listening on
    the same port with SO_REUSEPORT (the kernel spreads connections over them), forwards SIGTERM / SIGINT to
    them (each drains as a single-process server does) and exits when all have exited: 0 when every worker
    exited with 0, else 1 (a worker that fails stops the others). A worker whose parent dies drains and exits."""
    import multiprocessing
    import socket

    from recsvc.service.observability.logs import configure_json_logging

    from .settings import check_beam_width

    n = args.processes
    if args.port == 0:
        raise UserError(f"--processes {n} needs an explicit --port (the workers share it; 0 would give each "
                        "worker a different port)")
    if args.metrics_port is not None and args.metrics_port != 0 and args.metrics_port + n - 1 > 65535:
        raise UserError(f"--metrics-port {args.metrics_port} + {n - 1} workers exceeds 65535")
    if args.beam_width is not None:
        check_beam_width(args.beam_width)
    configure_json_logging(args.log_level.upper(), role="parent", pid=os.getpid())
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # no SO_REUSEPORT: fails if anything listens
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for index in range(n):
        proc = ctx.Process(target=worker_main, args=(args, index), name=f"recsvc-worker-{index}")
        proc.start()
        workers.append(proc)
    # SIGHUP: each worker loads the bundle version --bundle points to (recsvc.service.swap.bundle_watch)
    signal.signal(signal.SIGHUP, lambda _signum, _frame: [os.kill(w.pid, signal.SIGHUP) for w in workers
                                                          if w.is_alive()])
    log_step("workers_started", processes=n, port=args.port, pids=[w.pid for w in workers],
             metrics_ports=None if args.metrics_port is None
             else [args.metrics_port + i if args.metrics_port else 0 for i in range(n)])
    signalled = False
    while any(w.is_alive() for w in workers):
        failed = [i for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
        if (stop.is_set() or failed) and not signalled:
            if failed:
                log_step("worker_failed", logging.ERROR, workers=failed,
                         exitcodes=[workers[i].exitcode for i in failed])
            log_step("stopping_workers", reason="signal" if stop.is_set() else "worker_failed")
            for w in workers:
                if w.is_alive():
                    os.kill(w.pid, signal.SIGTERM)
            signalled = True
        time.sleep(0.1)
    for w in workers:
        w.join()
    codes = [w.exitcode for w in workers]
    log_step("workers_exited", exitcodes=codes)
    return 0 if all(code == 0 for code in codes) else 1
