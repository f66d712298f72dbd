"""Count the eager device operations a search runs: on a GPU each is (at least) one kernel launch from Python.

At batch 1 a GPU search is bound by launches, not arithmetic (docs/GPU.md), so the count per request is the
hardware-independent figure to drive down, the way target forward calls are for speculation. Work replayed
from a captured CUDA graph does not pass through torch's dispatcher. On a CPU nothing is captured, so the
forward that a GPU would replay (the ``graphs`` forward's bucketed ``forward_static``) runs inside
``replayable()``: its operations are not counted and the forward counts as one replay (``replays``). So the count
on a CPU is what a GPU launches from Python, the graphs' input copies aside. Views and metadata-only operations
(``view``, ``expand``, ...) launch nothing and are left out.

    >>> import torch
    >>> with Launches() as n:
    ...     _ = torch.ones(3) + 1
    >>> n.total >= 1
    True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operations that only make a new view or read metadata (no kernel)
_NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze",
              "permute", "transpose", "t", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk",
              "narrow", "diagonal", "lift_fresh", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
              "is_same_size", "empty", "empty_strided", "empty_like", "_to_copy_meta"}


_REPLAYED: ContextVar[bool] = ContextVar("recsvc_replayed", default=False)
_OPEN: list[Launches] = []  # the counters open now (innermost last)


@contextmanager
def replayable(device: torch.device | None = None) -> Iterator[None]:
    """Marks work that a GPU replays as one captured graph, run eagerly here on ``device``: on a CUDA device the
    work really launches and is counted as such; elsewhere (default) it counts as one replay."""
    if _REPLAYED.get() or (device is not None and device.type == "cuda"):
        yield
        return
    for counter in _OPEN:
        counter.replays += 1
    token = _REPLAYED.set(True)
    try:
        yield
    finally:
        _REPLAYED.reset(token)


class _Mode(TorchDispatchMode):
    def __init__(self, owner: Launches) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in _NO_KERNEL and not _REPLAYED.get():
            self.owner.total += 1
            self.owner.by_op[name] += 1
        return func(*args, **(kwargs or {}))


class Launches:
    """``with Launches() as n: search()`` -> ``n.total`` device operations run eagerly, ``n.by_op`` by name,
    ``n.replays`` forwards a GPU replays as captured graphs."""

    def __init__(self) -> None:
        self.total = 0
        self.replays = 0
        self.by_op: Counter[str] = Counter()
        self._mode: _Mode | None = None

    def __enter__(self) -> Launches:
        self._mode = _Mode(self)
        self._mode.__enter__()
        _OPEN.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        _OPEN.remove(self)
        self._mode.__exit__(*exc)
        self._mode = None

    def summary(self, top: int = 10) -> dict:
        return {"total": self.total, "replays": self.replays, "by_op": dict(self.by_op.most_common(top))}
