"""Whole forwards of the fast forward as CUDA graphs, one per bucket (``recsvc.engine.kernels.buckets``).

At batch 1 a forward of the engine is a few hundred small kernels launched from Python; on a GPU their launch
costs more than their work. ``GraphRunner`` captures ``FastLlama.forward_static`` (embedding, rotary, every
decoder layer, the final norm) once per bucket (rows, new tokens, visible slots, kept rows) with
``torch.cuda.CUDAGraph`` and replays it: the inputs are copied into the bucket's static tensors, the keys /
values are written into the static KV pool's buffers (fixed addresses), the output is copied out of the graph's
static output. All graphs share one memory pool (they never run concurrently; each output is copied before the
next replay).

Capture happens on a bucket's first use (two eager warm-up runs on a side stream, then the capture); the
number of graphs is bounded (``max_graphs``; past it, buckets run eagerly at their padded shapes) and every
capture is logged with its time. ``warm_up`` runs a caller's representative searches once at start-up so the
buckets they use are captured before the first request, within a time budget.

Only on CUDA (``torch.cuda.is_available()`` and the model on a CUDA device); elsewhere the bucketed path runs
the same code eagerly (``recsvc.engine.kernels.buckets``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from recsvc.engine.kernels.buckets import BucketedForward, PaddedInputs, StaticCache
from recsvc.engine.meters.launches import replayable

log = logging.getLogger(__name__)
T = TypeVar("T")


def cuda_graphs_available(device: torch.device) -> bool:
    return torch.cuda.is_available() and device.type == "cuda"


def _capture_graph(step: Callable[[], T], pool: object) -> tuple[object, T, object]:
    """``step`` (over static inputs) warmed up twice on a side stream (cuBLAS handles, workspace), then captured
    into a graph of the memory ``pool`` (made on first use) -> (graph, its static output, the pool)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads' work goes on
        output = step()
    return graph, output, pool


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    inputs: PaddedInputs  # static input tensors
    output: torch.Tensor  # static output
    replays: int = 0


@dataclass
class GraphRunner:
    max_graphs: int = 256
    graphs: dict[tuple[int, int, int, int], _Graph] = field(default_factory=dict)
    capture_s: float = 0.0  # seconds spent capturing
    eager: int = 0  # forwards run eagerly (past max_graphs, or after a failed capture)
    failed: str = ""  # the first capture's error, if one failed (every bucket then runs eagerly)
    _pool: object = None

    def run(self, fwd: BucketedForward, cache: StaticCache, x: PaddedInputs) -> torch.Tensor:
        """The bucket's graph replayed on ``x`` (captured on first use); ``cache`` holds the pool's buffers."""
        rows, tokens = x.ids.shape
        width = x.visible.shape[2]
        key = (rows, tokens, width, -1 if x.keep is None else int(x.keep.shape[1]))
        g = self.graphs.get(key)
        if g is None:
            if len(self.graphs) < self.max_graphs and not self.failed:
                try:
                    g = self._capture(fwd, cache, key, x)
                except RuntimeError as exc:  # an op the capture refuses: log it once, run eagerly from now on
                    self.failed = repr(exc)[:500]
                    log.warning("CUDA graph capture failed (%s); the bucketed forward runs eagerly", self.failed)
            if g is None:
                self.eager += 1
                keys, values = cache.buffers_of(rows, width)
                return fwd.fast.forward_static(keys, values, x.ids, x.positions, x.slots, x.visible, x.keep)
        _copy_inputs(g.inputs, x)
        g.graph.replay()  # type: ignore[attr-defined]
        g.replays += 1
        return g.output.clone()

    def _capture(self, fwd: BucketedForward, cache: StaticCache, key: tuple[int, int, int, int],
                 x: PaddedInputs) -> _Graph:
        start = time.perf_counter()
        rows, _, width, _ = key
        static = PaddedInputs(x.ids.clone(), x.positions.clone(), x.slots.clone(), x.visible.clone(),
                              None if x.keep is None else x.keep.clone())
        keys, values = cache.buffers_of(rows, width)  # the pool's buffers: the same for every leasing cache

        def step() -> torch.Tensor:
            return fwd.fast.forward_static(keys, values, static.ids, static.positions, static.slots,
                                           static.visible, static.keep)

        graph, output, self._pool = _capture_graph(step, self._pool)
        g = _Graph(graph, static, output)
        self.graphs[key] = g
        took = time.perf_counter() - start
        self.capture_s += took
        log.info("captured CUDA graph %d (rows %d, tokens %d, slots %d, kept %d) in %.2f s", len(self.graphs),
                 *key, took)
        return g

    def summary(self) -> dict:
        return {"graphs": len(self.graphs), "capture_s": round(self.capture_s, 3), "eager_forwards": self.eager,
                "replays": sum(g.replays for g in self.graphs.values()), "failed": self.failed}


@dataclass
class _FnGraph:
    graph: object  # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]  # static input tensors (None: an absent optional input)
    outputs: tuple[torch.Tensor, ...]  # static outputs
    replays: int = 0


Inputs = tuple[torch.Tensor | None, ...]


@dataclass
class FunctionGraphs:
    """Pure device functions of tensors, each captured as a CUDA graph per key and replayed: the eager work
    between two forwards (a plain step's LM head, trie expansion and selection: ~100 small kernels) becomes one
    launch. ``fn(*inputs)`` must read nothing from the host and allocate no shape that depends on the data (the
    sync-free searches), and may read other tensors only if their addresses and contents never change (the trie's
    tables, the model's weights). The key names the function and every Python value it bakes in; the inputs'
    shapes, dtypes and absences are added to it.

    ``capture`` False (a CPU, or the ``bucketed`` forward on a GPU): ``fn`` runs eagerly; off CUDA inside
    ``launches.replayable`` (a CPU's launch count then shows what a GPU launches). A capture that fails is logged
    once and every key then runs eagerly."""

    capture: bool = False
    max_graphs: int = 128
    graphs: dict[tuple, _FnGraph] = field(default_factory=dict)
    capture_s: float = 0.0
    eager: int = 0  # calls run eagerly with capture on (past max_graphs, or after a failed capture)
    failed: str = ""
    _pool: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Inputs) -> tuple[torch.Tensor, ...]:
        if not self.capture:
            with replayable(next(t for t in inputs if t is not None).device):
                return fn(*inputs)
        full = (*key, *((None if t is None else (tuple(t.shape), t.dtype)) for t in inputs))
        with self._lock:  # one caller's copy, replay and clone enqueued together (shared static inputs)
            return self._run(full, fn, inputs)

    def _run(self, full: tuple, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Inputs
             ) -> tuple[torch.Tensor, ...]:
        g = self.graphs.get(full)
        if g is None:
            if len(self.graphs) < self.max_graphs and not self.failed:
                try:
                    g = self._capture(full, fn, inputs)
                except RuntimeError as exc:
                    self.failed = repr(exc)[:500]
                    log.warning("CUDA graph capture of a step failed (%s); steps run eagerly", self.failed)
            if g is None:
                self.eager += 1
                return fn(*inputs)
        for dst, src in zip(g.inputs, inputs, strict=True):
            if dst is not None:
                dst.copy_(src)
        g.graph.replay()  # type: ignore[attr-defined]
        g.replays += 1
        return tuple(o.clone() for o in g.outputs)

    def _capture(self, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Inputs) -> _FnGraph:
        start = time.perf_counter()
        static = tuple(None if t is None else t.clone() for t in inputs)
        graph, outputs, self._pool = _capture_graph(lambda: tuple(fn(*static)), self._pool)
        g = _FnGraph(graph, static, outputs)
        self.graphs[key] = g
        took = time.perf_counter() - start
        self.capture_s += took
        log.info("captured CUDA graph of %s in %.2f s", key[0], took)
        return g

    def summary(self) -> dict:
        return {"graphs": len(self.graphs), "capture_s": round(self.capture_s, 3), "eager_calls": self.eager,
                "replays": sum(g.replays for g in self.graphs.values()), "failed": self.failed}


def _copy_inputs(dst: PaddedInputs, src: PaddedInputs) -> None:
    dst.ids.copy_(src.ids)
    dst.positions.copy_(src.positions)
    dst.slots.copy_(src.slots)
    dst.visible.copy_(src.visible)
    if dst.keep is not None and src.keep is not None:
        dst.keep.copy_(src.keep)


def warm_up(models: list, searches: list[Callable[[], object]], budget_s: float) -> dict:
    """Run representative searches once each (their buckets get captured) until ``budget_s`` seconds are
    spent; returns and logs what the ``models``' (``EngineModel``) graph runners captured."""
    start = time.perf_counter()
    done = 0
    for search in searches:
        if time.perf_counter() - start > budget_s:
            break
        search()
        done += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    runners = [m.graph_runner for m in models if m.graph_runner is not None]
    graphs = sum(len(r.graphs) for r in runners)
    log.info("CUDA graph warm-up: %d of %d searches, %d graphs, %.1f s (budget %.0f s)", done, len(searches),
             graphs, took, budget_s)
    return {"searches": done, "of": len(searches), "graphs": graphs, "seconds": round(took, 2),
            "budget_s": budget_s, "runners": [r.summary() for r in runners]}
