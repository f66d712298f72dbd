"""A learning-rate schedule sized to the wall-clock budget (``--fit-budget``).

``--max-minutes`` alone stops a run when the budget is spent, wherever the warmup/cosine schedule is: on a large
catalog that means stopping at a high learning rate, an unconverged model. With ``--fit-budget`` the loop first
measures what an epoch costs on this machine (a few timed optimizer steps on a throw-away copy of the model, and
one validation pass), then runs the whole schedule over the epochs that fit the budget (at most ``--epochs``), so
the learning rate has annealed when the budget ends. The plan is saved with the checkpoint: a resumed run keeps
the schedule it started with.

The probe is only as good as the machine is quiet: another job on the same cores slows the timed steps (threads
that wait on each other's cores can run many times slower), and the plan then fits fewer epochs than the run
will have. The plan records how many cores other processes kept busy while the steps were timed
(``other_cores``, from the machine's and this process's CPU time; Linux), and ``contention_warning`` says so when
it is at least ``CONTENDED_CORES``.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

PROBE_WARMUP = 3  # steps not timed (allocator and kernel warm-up)
CONTENDED_CORES = 0.5  # other processes' CPU use during the probe (cores) from which the plan is flagged


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) now; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), time.process_time()


def other_cores(before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float
                ) -> float | None:
    """Cores that other processes kept busy between two ``cpu_seconds`` readings ``wall_s`` apart.

    >>> other_cores((100.0, 10.0), (103.0, 11.0), 2.0)  # 3 s busy, 1 s of it ours, over 2 s: one core
    1.0
    """
    if before is None or after is None or wall_s <= 0:
        return None
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / wall_s)


def contention_warning(plan: dict[str, Any] | None) -> str | None:
    """A line for the log when other processes used the cores while the plan was measured, else None."""
    cores = (plan or {}).get("other_cores")
    if cores is None or cores < CONTENDED_CORES:
        return None
    return (f"--fit-budget: other processes kept {cores:.1f} core(s) busy while the epoch was timed, so it was "
            f"timed slow and the schedule may be shorter than the budget allows; plan on an idle machine")


def time_steps(model, make_batch: Callable[[list[int]], dict[str, torch.Tensor]],
               loss_fn: Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, int]],
               batches: list[list[int]], lr: float, weight_decay: float, bf16: bool) -> tuple[float, int]:
    """(seconds, real tokens) of AdamW steps on ``batches`` after ``PROBE_WARMUP`` untimed ones.

    The model is trained in place: pass a throw-away copy. Padding is work but not a token (as in the loop's
    tokens/s display): the rate is real tokens per second of a padded, length-bucketed batch stream."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    device_type = next(model.parameters()).device.type  # autocast where the model runs (cpu or cuda)
    model.train()
    tokens, start = 0, time.perf_counter()
    for i, idx in enumerate(batches):
        if i == PROBE_WARMUP:
            tokens, start = 0, time.perf_counter()
        batch = make_batch(idx)
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(batch["num_tokens"]) if "num_tokens" in batch else int(batch["attention_mask"].sum())
    return time.perf_counter() - start, tokens


def epochs_in_budget(budget_s: float, spent_s: float, epoch_s: float, eval_s: float, max_epochs: int) -> int:
    """Whole epochs (training + one validation pass each) that fit what is left of the budget; 1..max_epochs.

    >>> epochs_in_budget(budget_s=3300, spent_s=60, epoch_s=600, eval_s=30, max_epochs=8)
    5
    >>> epochs_in_budget(budget_s=100, spent_s=60, epoch_s=600, eval_s=30, max_epochs=8)  # never below one
    1
    >>> epochs_in_budget(budget_s=1e6, spent_s=0, epoch_s=60, eval_s=5, max_epochs=6)  # capped by --epochs
    6
    """
    per_epoch = epoch_s + eval_s
    if per_epoch <= 0 or not math.isfinite(per_epoch):
        return max_epochs
    return max(1, min(max_epochs, math.floor((budget_s - spent_s) / per_epoch)))


def plan_schedule(model, make_batch, loss_fn, lengths: list[int], batch_size: int, world: int, lr: float,
                  weight_decay: float, bf16: bool, evaluate: Callable[[Any], object], budget_minutes: float,
                  spent_s: float, max_epochs: int, steps: int = 20, seed: int = 0) -> dict[str, Any]:
    """Measure an epoch's cost and choose the schedule's epochs (the ``--fit-budget`` plan, JSON-ready).

    ``evaluate(model)`` is one validation pass (timed once, on the untrained copy: beam search costs the same
    whatever the weights). ``world`` processes share an epoch's batches."""
    from training.target_lm.sequences import bucketed_batches

    t0 = time.monotonic()
    probe = copy.deepcopy(model)
    batches = bucketed_batches(lengths, batch_size, seed=seed)
    n_batches = max(1, math.ceil(len(lengths) / batch_size) // world)
    probed = batches[:PROBE_WARMUP + steps]
    before, w0 = cpu_seconds(), time.perf_counter()
    seconds, tokens = time_steps(probe, make_batch, loss_fn, probed, lr, weight_decay, bf16)
    others = other_cores(before, cpu_seconds(), time.perf_counter() - w0)
    timed = probed[PROBE_WARMUP:]

    def area(idx: list[int]) -> int:  # a padded batch's size: what a step's cost grows with
        return max(lengths[i] for i in idx) * len(idx)

    # batch sizes vary a lot (length buckets): scale by padded area, not by the count of batches
    s_per_area = seconds / max(sum(area(b) for b in timed), 1)
    probe.eval()
    e0 = time.perf_counter()
    with torch.no_grad():
        evaluate(probe)
    eval_s = time.perf_counter() - e0
    del probe
    epoch_s = s_per_area * sum(area(b) for b in batches[::world][:n_batches])
    spent = spent_s + time.monotonic() - t0
    epochs = epochs_in_budget(budget_minutes * 60, spent, epoch_s, eval_s, max_epochs)
    return {"budget_minutes": budget_minutes, "max_epochs": max_epochs, "epochs": epochs,
            "probe_steps": len(timed), "train_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "epoch_seconds": round(epoch_s, 2), "eval_seconds": round(eval_s, 3), "planning_seconds": round(spent, 2),
            "epochs_fit": round((budget_minutes * 60 - spent) / max(epoch_s + eval_s, 1e-9), 2),
            "other_cores": round(others, 2) if others is not None else None}


def default_patience(patience: int | None, fit_budget: bool) -> int:
    """``--patience`` as given, else 2, or 0 (off) under ``--fit-budget``.

    A schedule sized to the budget reaches its low learning rates only in its last epochs, and validation in the
    middle of it is noisy: with the `small` target on Beauty, one seed's validation Recall@10 rose every epoch to
    the sixth, another's dipped at the third (0.0285 -> 0.0188) and patience 2 stopped it at the fourth, before the
    schedule annealed. The budget already bounds the time, so the whole schedule runs and the best epoch is kept.

    >>> default_patience(None, False), default_patience(None, True), default_patience(3, True)
    (2, 0, 3)
    """
    if patience is not None:
        return patience
    return 0 if fit_budget else 2
