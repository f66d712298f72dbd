"""The linear-layer floor of a request (``recsvc bench cache``): what the target's matmuls alone cost.

The target's own linear layers (the fast forward's packed fp32 kernels, ``recsvc.engine.kernels.fast``, on the model's
real weights) run back to back in a tight loop, with nothing else (no norms, attention, masks, trie, Python
around them), at the row counts of one request:
- one forward at 1 row: every weight matrix read once, so its time is the weight-streaming floor of any
  forward (and weight bytes / time the rate the weights stream at);
- an uncached plain request: the prompt forward at T rows (as the prefill runs it: the last layer's k / v at
  T rows, its q, o-projection and MLP and the LM head at the 1 row that feeds the head) + (levels - 1) decode
  forwards at K rows (every linear and the LM head at the K beams);
- a prompt-cached request: the decode forwards alone.
Each figure is the median over ``reps`` timed passes (after warm-up passes). A path can at best cost these
(its other work is extra), so floor / a path's p50 bounds the speed-up any change to the rest can bring.

Shapes: M rows per call, I in features.
"""

from __future__ import annotations

import statistics
import time

import torch

from recsvc.engine.kernels.engine_model import EngineModel
from recsvc.engine.kernels.fast import FastLlama
from recsvc.engine.kernels.pieces import FastLinear

Plan = list[tuple[FastLinear, int]]  # (linear, rows) in call order
MEASURED = ("the target's packed linear layers on its real weights alone, back to back, median of timed passes: "
            "1 row per forward; an uncached request = a prefill of the median prompt (last layer: k/v at every "
            "token, the rest and the LM head at 1 row) + (levels - 1) decode forwards at B rows; a prompt-cached "
            "request = the decode forwards")


def forward_plan(fast: FastLlama, rows: int) -> Plan:
    """Every linear of one forward at ``rows`` rows, and the LM head on them (a decode step)."""
    plan = [(lin, rows) for layer in fast.layers for lin in (layer[2], layer[3], layer[6], layer[7])]
    return [*plan, (fast.lm_head, rows)]


def prompt_plan(fast: FastLlama, tokens: int) -> Plan:
    """The linears of one prompt prefill of ``tokens`` tokens (the last layer pruned to the head's 1 row)."""
    plan = forward_plan(fast, tokens)[: 4 * (len(fast.layers) - 1)]
    assert fast.last_q is not None and fast.last_kv is not None
    last = fast.layers[-1]
    return [*plan, (fast.last_kv, tokens), (fast.last_q, 1), (last[3], 1), (last[6], 1), (last[7], 1),
            (fast.lm_head, 1)]


def weight_bytes(plan: Plan) -> int:
    return sum(lin.weight.numel() * lin.weight.element_size() for lin, _ in plan if lin.weight is not None)


@torch.inference_mode()
def time_plan(plan: Plan, reps: int = 30, warmup: int = 3) -> float:
    """Median ms of one pass over ``plan`` (each call on its own random [M, I] input, made beforehand)."""
    gen = torch.Generator().manual_seed(0)
    calls = []
    for lin, rows in plan:
        assert lin.weight is not None
        calls.append((lin, torch.randn(rows, lin.weight.shape[1], generator=gen, dtype=lin.weight.dtype)))
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        for lin, x in calls:
            lin(x)
        if i >= warmup:
            times.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(model: EngineModel, prompt_tokens: int, beams: int, decode_forwards: int, reps: int = 30) -> dict | None:
    """The floor figures of ``model`` (its fast forward; None when the fast forward does not serve it: a model
    or device the lean path serves)."""
    if not model.plan.fast:
        return None
    fast = model.fast()
    one = forward_plan(fast, 1)
    floor = time_plan(one, reps)
    decode = time_plan(forward_plan(fast, beams), reps)
    prompt = time_plan(prompt_plan(fast, prompt_tokens), reps)
    size = weight_bytes(one)
    return {"floor_ms_per_forward": floor, "weight_bytes": size, "weight_GBps": size / floor / 1e6,
            "floor_prompt_tokens": prompt_tokens, "floor_beams": beams, "floor_decode_forwards": decode_forwards,
            "floor_prompt_forward_ms": prompt, "floor_decode_forward_ms": decode,
            "floor_uncached_ms": prompt + decode_forwards * decode, "floor_cached_ms": decode_forwards * decode,
            "floor_reps": reps}
