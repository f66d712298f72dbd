"""The pieces the engine's forwards are built of, written once: linear layers and a layer's keys / values.

- a linear layer (``F.linear(x, weight)``, no bias) whose weight may be pre-packed for oneDNN once instead of at
  every call: ``LeanLinear`` packs only where the packed kernel returns ``F.linear``'s very bits (bf16 on a CPU;
  the lean forward, ``recsvc.engine.kernels.lean``, is transformers' numerics bit for bit); ``FastLinear`` (the
  fast forward, ``recsvc.engine.kernels.fast``) also packs fp32 weights where a row's result does not depend on
  the other rows of the call;
- one layer's keys and values: ``LeanKV`` (the lean cache's, token-major, appended per call) and ``FastKV`` (the
  fast cache's, a preallocated buffer whose slots are written in place; the static cache of
  ``recsvc.engine.kernels.buckets`` keeps its buffers at fixed addresses on top of it).
Both KV forms read and replace their used part through ``keys`` / ``values`` [B, h_kv, S, d], the interface
``TreeCache.compact`` / ``select_rows`` use.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
import torch.nn.functional as F

GROW = 64  # minimum extra slots when a fast cache grows


class Rows(Protocol):
    """The cache a ``FastKV`` layer belongs to: its rows in use (a compaction or row selection sets them)."""

    batch: int


class LeanLinear:
    """``F.linear(x, weight)`` (no bias); on CPU in bf16 with the weight pre-packed for oneDNN once, instead of
    at every call, when a probe shows the packed kernel returns the very bits ``F.linear`` returns."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight: torch.Tensor | None = weight.detach()
        self.packed: torch.Tensor | None = None
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 16)
                gen = torch.Generator().manual_seed(0)
                probe = [torch.randn(m, weight.shape[1], generator=gen).to(weight.dtype) for m in (1, 10, 37, 130)]
                if all(torch.equal(self._packed(x, packed), F.linear(x, self.weight)) for x in probe):
                    self.packed = packed
                    self.weight = None  # the packed copy is all it needs
            except (RuntimeError, AttributeError):  # a build without these ops: plain F.linear
                self.packed = None

    @staticmethod
    def _packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight)
        shape = x.shape
        return self._packed(x.reshape(-1, shape[-1]), self.packed).view(*shape[:-1], -1)


class FastLinear(LeanLinear):
    """``F.linear(x, weight)``; fp32 on CPU: oneDNN with a pre-packed weight when its rows are row-independent;
    bf16 on CPU: lean's packing (its probe asks for F.linear's very bits). The weight is kept beside the packed
    copy (the compiled layers freeze it into their graph)."""

    pack = True  # class-wide switch (benchmarks compare)

    def __init__(self, weight: torch.Tensor) -> None:
        if self.pack and weight.dtype == torch.bfloat16:
            super().__init__(weight)  # packed when it gives F.linear's bits
            self.weight = weight.detach().contiguous()
            if self.packed is not None and not self._row_independent(self.packed):
                self.packed = None
            return
        self.weight: torch.Tensor | None = weight.detach().contiguous()
        self.packed: torch.Tensor | None = None
        if (self.pack and weight.device.type == "cpu" and weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available()):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 20)
                if self._row_independent(packed):
                    self.packed = packed
            except (RuntimeError, AttributeError):  # a build without these ops: plain F.linear
                self.packed = None

    def _row_independent(self, packed: torch.Tensor) -> bool:
        """Whether the packed kernel's result for a row is the same in calls of 1 to 130 rows."""
        assert self.weight is not None
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(130, self.weight.shape[1], generator=gen).to(self.weight)
        whole = self._packed(x, packed)
        return all(torch.equal(self._packed(x[:m], packed), whole[:m]) for m in (1, 2, 3, 10, 20, 37, 64))


class LeanKV:
    """One layer's keys and values, stored token-major ([B, S, h_kv, d] contiguous) and seen as transformers'
    [B, h_kv, S, d]: gathering a token's key slots (exact tree attention) is then a plain row gather, with no
    transposing copy of the whole cache per layer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    @property
    def keys(self) -> torch.Tensor:  # [B, h_kv, S, d] (a view)
        return self._k.transpose(1, 2)

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:
        self._k = value.transpose(1, 2).contiguous()

    @property
    def values(self) -> torch.Tensor:
        return self._v.transpose(1, 2)

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        self._v = value.transpose(1, 2).contiguous()

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # [B, h_kv, n, d] each
        self._k = torch.cat([self._k, k.transpose(1, 2)], 1)
        self._v = torch.cat([self._v, v.transpose(1, 2)], 1)


class FastKV:
    """One layer's keys and values in a preallocated buffer [B, h_kv, capacity, d] (grown by doubling): new tokens
    are written into their slots in place; ``keys`` / ``values`` read and replace the used part."""

    def __init__(self, cache: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache, self.k, self.v = cache, k, v
        self.n = self.n_v = 0  # slots in use (keys, values: replaced one after the other by a compaction)

    # the cache is held weakly: a reference cycle (cache -> layers -> cache) would keep a finished search's keys
    # and values (and a static cache's pool lease) alive until the cyclic collector ran, and a retired bundle
    # version's forward with them for good once ``gc.freeze`` had moved it out of the collector's reach
    @property
    def cache(self) -> Rows:
        cache = self._cache()
        assert cache is not None, "a KV cache layer outlived its cache"
        return cache

    @cache.setter
    def cache(self, value: Rows) -> None:
        self._cache = weakref.ref(value)

    def reserve(self, width: int) -> None:
        cap = self.k.shape[2]
        if width > cap:
            new = max(width + GROW, 2 * cap)
            k = self.k.new_zeros(self.k.shape[0], self.k.shape[1], new, self.k.shape[3])
            v = torch.zeros_like(k)
            k[:, :, :self.n], v[:, :, :self.n] = self.k[:, :, :self.n], self.v[:, :, :self.n]
            self.k, self.v = k, v
        self.n = self.n_v = max(self.n, width)

    @property
    def keys(self) -> torch.Tensor:  # [B, h_kv, S, d] (a view)
        return self.k[:, :, : self.n]

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:  # a replacement of the used part (compaction / row selection)
        self.k = self._buffer(value)
        self.n = int(value.shape[2])

    @property
    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.n_v]

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        self.v = self._buffer(value)
        self.n_v = int(value.shape[2])
        self.cache.batch = int(value.shape[0])

    @staticmethod
    def _buffer(value: torch.Tensor) -> torch.Tensor:
        b, h, s, d = value.shape
        buf = value.new_zeros(b, h, s + GROW, d)
        buf[:, :, :s] = value
        return buf
