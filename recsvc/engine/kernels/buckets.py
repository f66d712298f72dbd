"""The fast forward at bucketed, padded shapes over a static KV cache: what a CUDA graph can replay.

A CUDA graph replays fixed kernels on fixed buffers, so every forward of a search must come in one of a few
shapes and write its keys / values into buffers that never move. ``BucketedForward`` does both, on any device
(the same code on a CPU, minus the capture, so CPU tests hold it to today's results):
- **shapes by bucket**: a forward of B rows, q new tokens and S visible slots runs at (B_b, q_b, S_b), the
  smallest buckets holding them (``Buckets``); padded rows and padded tokens see only their own slot (no
  NaN, no effect on real rows), their outputs are dropped; padded tokens of real rows write their keys /
  values to slots past the cache's width, which nothing sees before a later forward overwrites them;
- **a static KV cache**: ``StaticCache`` keeps each layer's keys / values in buffers of B_max rows and a
  fixed slot capacity, allocated once per model (``StaticPool``) and lent to one search at a time (a second
  search alive at once gets its own buffers and runs uncaptured). Compaction and row selection copy into the
  buffers in place; they never reallocate;
- **no host read**: ``FastLlama.forward_static`` (the rotary table indexed without a range check; shapes come
  from the inputs' shapes).
With ``graphs`` (``recsvc.engine.kernels.cuda_graphs.GraphRunner``; CUDA only) each bucket's forward is captured once
and replayed; otherwise it runs eagerly at the padded shapes.

Numerics: the real rows see exactly the slots they saw unpadded; padded key columns are masked out, so they
change a result only by the order the attention kernel sums in (float rounding, like the fast forward's own
tolerance: tests hold the bucketed path to the fast path's lists, scores within 1e-4 in fp32).

Shapes: B rows, q new tokens, S slots, H hidden, h_kv kv heads, d head dim.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recsvc.engine.kernels.fast import FastCache, FastLlama
from recsvc.engine.kernels.pieces import FastKV
from recsvc.engine.meters.launches import replayable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Buckets:
    rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 20, 24, 32, 40, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768,
                               1024)
    widths: tuple[int, ...] = (64, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 3072, 4096)

    @staticmethod
    def fit(sizes: Sequence[int], n: int) -> int | None:
        """The smallest bucket >= n, or None when n is past the largest."""
        for size in sizes:
            if size >= n:
                return size
        return None

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    @property
    def capacity(self) -> int:
        return self.widths[-1]


class StaticPool:
    """One model's static KV buffers ([B_max, h_kv, capacity, d] per layer, zeros at first), lent to one
    ``StaticCache`` at a time (the lease ends when that cache is garbage: a search's caches live as long as
    the search)."""

    def __init__(self, fast: FastLlama, buckets: Buckets) -> None:
        self.fast, self.buckets = fast, buckets
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._holder: weakref.ref | None = None

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._buffers is None:
            f, b = self.fast, self.buckets
            shape = (b.max_rows, f.kv_heads, b.capacity, f.head_dim)
            self._buffers = [(torch.zeros(shape, dtype=f.dtype, device=f.device),
                              torch.zeros(shape, dtype=f.dtype, device=f.device)) for _ in f.layers]
            mib = 2 * len(f.layers) * self._buffers[0][0].numel() * self._buffers[0][0].element_size() / 2**20
            log.info("static KV cache: %d layers x [%d, %d, %d, %d] %s (%.0f MiB)", len(f.layers), *shape,
                     f.dtype, mib)
        return self._buffers

    def lease(self, cache: StaticCache) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The pool's buffers for ``cache``, or None while another live cache holds them."""
        if self._holder is not None and self._holder() is not None and self._holder() is not cache:
            return None
        self._holder = weakref.ref(cache)
        return self.buffers()

    def holds(self, cache: StaticCache) -> bool:
        return self._holder is not None and self._holder() is cache


class StaticCache(FastCache):
    """A ``FastCache`` whose per-layer buffers never move: the pool's when it is free (graphs can replay on
    them), else its own. Rows and slots past the used part are padding."""

    def __init__(self, fast: FastLlama, pool: StaticPool, batch: int = 0) -> None:
        super().__init__(fast, batch)
        self.pool = pool
        self.leased = False

    def reserve(self, width: int, batch: int) -> None:
        if not self.layers:
            self.batch = batch
            b = self.pool.buckets
            rows = Buckets.fit(b.rows, batch) or batch
            bufs = self.pool.lease(self) if rows <= b.max_rows and width <= b.capacity else None
            self.leased = bufs is not None
            if bufs is None:  # another search holds the pool, or a batch / width past it: private buffers
                f = self.fast
                shape = (rows, f.kv_heads, max(width, Buckets.fit(b.widths, width) or width), f.head_dim)
                bufs = [(torch.zeros(shape, dtype=f.dtype, device=f.device),
                         torch.zeros(shape, dtype=f.dtype, device=f.device)) for _ in f.layers]
            self.layers = [_StaticKV(self, k, v, batch) for k, v in bufs]
        for layer in self.layers:
            layer.reserve(width)

    def ensure(self, rows: int, width: int) -> None:
        """Buffers of at least ``rows`` rows and ``width`` slots (a padded forward's); past the pool's size the
        cache moves to private buffers (and runs uncaptured from then on)."""
        for layer in self.layers:
            layer.ensure(rows, width)

    def buffers_of(self, rows: int, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, views [rows, h_kv, width, d] of the key / value buffers (fixed addresses)."""
        return ([kv.k[:rows, :, :width] for kv in self.layers], [kv.v[:rows, :, :width] for kv in self.layers])


class _StaticKV(FastKV):
    def __init__(self, cache: StaticCache, k: torch.Tensor, v: torch.Tensor, batch: int) -> None:
        super().__init__(cache, k, v)
        self.rows_k = self.rows_v = batch  # rows in use (keys, values: replaced one after the other)

    def reserve(self, width: int) -> None:
        self.ensure(self.k.shape[0], width)
        self.n = self.n_v = max(self.n, width)

    def ensure(self, rows: int, width: int) -> None:
        if rows <= self.k.shape[0] and width <= self.k.shape[2]:
            return
        rows, cap = max(rows, self.k.shape[0]), max(width, 2 * self.k.shape[2])
        k = self.k.new_zeros(rows, self.k.shape[1], cap, self.k.shape[3])
        v = torch.zeros_like(k)
        k[:self.k.shape[0], :, :self.k.shape[2]] = self.k
        v[:self.v.shape[0], :, :self.v.shape[2]] = self.v
        self.k, self.v = k, v
        cache = self.cache
        assert isinstance(cache, StaticCache)
        if cache.leased:
            log.info("static KV cache outgrown (%d rows, %d slots): private buffers, uncaptured", rows, width)
            cache.leased = False

    @property
    def keys(self) -> torch.Tensor:  # [B, h_kv, S, d] (a view)
        return self.k[:self.rows_k, :, :self.n]

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:  # compaction / row selection: copied in place
        b, _, s, _ = value.shape
        self.ensure(b, s)
        self.k[:b, :, :s].copy_(value.clone() if _shares(value, self.k) else value)
        self.n, self.rows_k = int(s), int(b)

    @property
    def values(self) -> torch.Tensor:
        return self.v[:self.rows_v, :, :self.n_v]

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        b, _, s, _ = value.shape
        self.ensure(b, s)
        self.v[:b, :, :s].copy_(value.clone() if _shares(value, self.v) else value)
        self.n_v, self.rows_v = int(s), int(b)
        self.cache.batch = int(b)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass
class PaddedInputs:
    """One bucket's inputs: ids / positions / slots [B_b, q_b], visible [B_b, q_b, S_b], keep [B_b, r] or None."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    visible: torch.Tensor
    keep: torch.Tensor | None


def pad_inputs(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
               keep: torch.Tensor | None, rows: int, tokens: int, width: int) -> PaddedInputs:
    """Pad a forward's inputs (B rows, q tokens, S slots) to (rows, tokens, width): padded tokens of real rows
    write to slots S, S + 1, ... and padded rows to slots 0, 1, ...; every padded token sees its own slot only;
    padded ``keep`` entries pick token 0. No host read, and few ops (each is a launch on a GPU).

    Every token the engine feeds sees its own slot already (``FastLlama.forward``'s contract), so marking every
    token's own slot visible changes only the padded ones."""
    b, q = ids.shape
    s = visible.shape[2]
    pad_bq = (0, tokens - q, 0, rows - b)
    col = torch.arange(tokens, device=ids.device)
    out_slots = torch.where(torch.arange(rows, device=ids.device)[:, None] < b, s - q + col, col)  # [rows, tokens]
    out_slots[:b, :q] = slots
    vis = F.pad(visible, (0, width - s, *pad_bq))  # False past the real part
    vis.scatter_(2, out_slots[..., None], True)  # each token's own slot
    out_keep = F.pad(keep, (0, 0, 0, rows - b)) if keep is not None else None
    return PaddedInputs(F.pad(ids, pad_bq), F.pad(positions, pad_bq), out_slots, vis, out_keep)


class BucketedForward:
    """``FastLlama.forward`` at bucketed shapes over a ``StaticCache``; with ``runner`` (CUDA graphs) a bucket's
    forward is a graph replay when the cache holds the pool's buffers."""

    def __init__(self, fast: FastLlama, buckets: Buckets | None = None, runner=None) -> None:
        self.fast, self.buckets = fast, buckets or Buckets()
        self.pool = StaticPool(fast, self.buckets)
        self.runner = runner  # recsvc.engine.kernels.cuda_graphs.GraphRunner or None
        self.unbucketed = 0  # forwards past the largest buckets (run at their own shapes)

    def new_cache(self) -> StaticCache:
        return StaticCache(self.fast, self.pool)

    def shape_of(self, b: int, q: int, s: int) -> tuple[int, int, int] | None:
        """The bucket (B_b, q_b, S_b) of a forward of b rows, q tokens and s slots, or None."""
        bk = self.buckets
        rows, tokens = Buckets.fit(bk.rows, b), Buckets.fit(bk.tokens, q)
        if rows is None or tokens is None:
            return None
        width = Buckets.fit(bk.widths, s + tokens - q)
        return None if width is None else (rows, tokens, width)

    def __call__(self, cache: StaticCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 visible: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``FastLlama.forward``'s contract: [B, q, H] (or [B, r, H] with ``keep``)."""
        b, q = ids.shape
        s = int(visible.shape[2])
        cache.reserve(s, b)
        shape = self.shape_of(b, q, s)
        if shape is None:  # past the buckets: the plain fast forward at its own shapes
            self.unbucketed += 1
            return self.fast.forward(cache, ids, positions, slots, visible, keep)
        rows, tokens, width = shape
        cache.ensure(rows, width)
        padded = pad_inputs(ids, positions, slots, visible, keep, rows, tokens, width)
        if self.runner is not None and cache.leased:
            out = self.runner.run(self, cache, padded)
        else:  # off CUDA this stands in for the graph a GPU replays (``launches.replayable``: counted as one)
            keys, values = cache.buffers_of(rows, width)
            with replayable(padded.ids.device):
                out = self.fast.forward_static(keys, values, padded.ids, padded.positions, padded.slots,
                                               padded.visible, padded.keep)
        return out[:b] if keep is not None else out[:b, :q]
