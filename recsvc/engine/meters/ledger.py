"""Phase timers kept outside the algorithms (the ml-recurrent-drafter "stats ledger" pattern).

A search takes an optional ``PhaseLedger`` and wraps each named phase in ``ledger.phase(name)``; the default
``NO_LEDGER`` costs one attribute lookup per phase and records nothing, so timing never changes results and
the search code reads as the algorithm. ``recsvc bench speculative`` passes a real ledger and reports ms per
request per phase for plain and speculative decoding side by side.

Phases: plain beam search: ``forward`` (prefill and the beams' decode steps), ``head`` (code log-probs from
the hidden states), ``select`` (trie masks, fused prior, top-K); speculative: ``draft`` (the drafter's
proposals), ``verify`` (the one target forward over the draft tree), ``replay`` (the target's log-probs at
the tree's nodes, its beam search over them and the acceptance test), ``commit`` (KV compaction, retiring
finished rows). Whatever a request spends outside these is "other" (the caller's total minus their sum).

    >>> ledger = PhaseLedger()
    >>> with ledger.phase("draft"):
    ...     pass
    >>> list(ledger.ms)
    ['draft']
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


class PhaseLedger:
    def __init__(self) -> None:
        self.ms: defaultdict[str, float] = defaultdict(float)  # phase -> milliseconds, summed over calls
        self.calls: defaultdict[str, int] = defaultdict(int)  # phase -> times entered

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._wait()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._wait()
            self.ms[name] += 1000.0 * (time.perf_counter() - start)
            self.calls[name] += 1

    def _wait(self) -> None:
        """Before and after each phase: nothing here (``SyncedLedger`` waits for the device)."""

    def total(self) -> float:
        return sum(self.ms.values())


class SyncedLedger(PhaseLedger):
    """A ``PhaseLedger`` that waits for the device's queue before and after each phase (CUDA), so a phase's time
    holds its own GPU work rather than whatever was queued before it. The waits slow the search: for a breakdown
    (``make gpu-bench``'s ``phases``), never for the headline timings."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cuda = torch.device(device).type == "cuda"

    def _wait(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class _NoLedger:
    def phase(self, name: str):  # noqa: ARG002 (same signature as PhaseLedger.phase)
        return nullcontext()


NO_LEDGER = _NoLedger()
Ledger = PhaseLedger | _NoLedger  # (a SyncedLedger is a PhaseLedger)


class ForwardLedger:
    """Every model forward's new tokens and milliseconds (``EngineModel.forward_ledger``; benches only), and
    the fixed cost per forward: the intercept of a least-squares line ms = fixed + per_token * tokens over
    the recorded forwards (what a forward costs before its first token: op dispatch, mask and cache
    bookkeeping, streaming the weights through the cache)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []  # (tokens = rows x new tokens, ms)

    @contextmanager
    def forward(self, tokens: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.calls.append((tokens, 1000.0 * (time.perf_counter() - start)))

    def fit(self) -> tuple[float, float]:
        """(fixed ms per forward, ms per token); (nan, nan) with fewer than two distinct token counts."""
        n = len(self.calls)
        xs = [float(t) for t, _ in self.calls]
        if n < 2 or len(set(xs)) < 2:
            return float("nan"), float("nan")
        ys = [ms for _, ms in self.calls]
        mx, my = sum(xs) / n, sum(ys) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        return my - slope * mx, slope
