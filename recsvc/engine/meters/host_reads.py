"""Counting the device-to-host reads of a search: ``HostReads``.

On a GPU every read of a device tensor's value by Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``,
``.cpu()``, an output whose shape depends on the data: ``nonzero``, ``unique``, boolean-mask indexing, ...)
waits for the device's queue to drain: the host cannot launch the next kernel before it, so every read costs
the latency of the work queued before it, and a graph replay cannot span it. ``HostReads`` counts them with a
``TorchFunctionMode`` (torch hands every tensor method and function to the innermost mode, so nothing is set on
torch's or the engine's objects): inside ``with HostReads(device) as reads:`` each such call on a tensor of
``device`` adds one, by operation and by the engine's source line that made it. On a CPU the very same calls
are counted (they are the reads the same code makes on a GPU), so a CPU test bounds a GPU's synchronisations.

The mode costs a Python call per torch call: counting runs are separate from timed runs (benches), and the
service counts only the requests it samples for it.

    >>> import torch
    >>> with HostReads("cpu") as reads:
    ...     n = int(torch.tensor([1, 2]).sum())
    >>> reads.total, dict(reads.by_op)
    (1, {'__int__': 1})
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# calls that read a tensor's value on the host (their result is a Python value or a host copy)
VALUE_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu",
                         "equal", "allclose", "__format__", "__repr__"})
# calls whose output shape depends on the data: the host must read how many elements come out
SHAPE_READS = frozenset({"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
                         "repeat_interleave"})
_PACKAGE_ROOTS = ("recsvc", "tokenizer_rqvae")
_SUSPENDED = [0]  # > 0 inside ``uncounted``


@contextmanager
def uncounted() -> Iterator[None]:
    """Reads made here are not counted: code that runs on a CPU only (consistency checks on CPU tensors, the
    selection's CPU-only tie test), so a CPU count stays the GPU's."""
    _SUSPENDED[0] += 1
    try:
        yield
    finally:
        _SUSPENDED[0] -= 1


def _tensors(args: Any) -> list[torch.Tensor]:
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (tuple, list)):
        return [t for a in args for t in _tensors(a)]
    return []


def _bool_index(index: Any) -> bool:
    """Whether an indexing key holds a boolean tensor (mask indexing: a nonzero under the hood)."""
    return any(t.dtype == torch.bool and t.dim() > 0 for t in _tensors(index))


class HostReads:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        """Count the reads of tensors on ``device`` ("cpu": every tensor, the CPU rehearsal of a GPU run)."""
        self.device = torch.device(device)
        self.total = 0
        self.by_op: Counter[str] = Counter()
        self.by_site: Counter[str] = Counter()  # "recsvc/engine/x.py:123" -> reads made there
        self._mode: _Mode | None = None

    def __enter__(self) -> HostReads:
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type

    def add(self, op: str) -> None:
        self.total += 1
        self.by_op[op] += 1
        self.by_site[_site()] += 1

    def summary(self, top: int = 12) -> dict:
        """JSON-ready: total, by operation, the sites that read most."""
        return {"total": self.total, "by_op": dict(self.by_op.most_common()),
                "by_site": dict(self.by_site.most_common(top))}


class ReadSampler:
    """Counts the host reads of every ``every``-th engine call of a recommender (0: none): the service's
    sampled figure (``RecStats.host_reads``, the ``recsvc_host_reads`` metric)."""

    def __init__(self, every: int = 0) -> None:
        self.every, self.calls = every, 0

    def due(self) -> bool:
        if self.every <= 0:
            return False
        self.calls += 1
        return self.calls % self.every == 0


@contextmanager
def sampled_reads(sampler: ReadSampler | None, device: torch.device) -> Iterator[HostReads | None]:
    """``with sampled_reads(sampler, device) as reads:`` counts the engine call inside under ``HostReads`` on
    ``device`` (the target's) when ``sampler`` is due (``reads`` is then the count), else counts nothing
    (``reads`` is None)."""
    if sampler is None or not sampler.due():
        yield None
        return
    with HostReads(device) as reads:
        yield reads


def is_read(name: str, args: tuple, kwargs: dict, on_device) -> bool:
    """Whether the call ``name(*args, **kwargs)`` reads a device tensor on the host."""
    tensors = _tensors(args[:1]) if args else []
    if not tensors or not on_device(tensors[0]):
        return False
    if name in VALUE_READS:
        return True
    if name == "to":  # a copy to the host
        dest = kwargs.get("device", args[1] if len(args) > 1 else None)
        return (isinstance(dest, (str, torch.device)) and torch.device(dest).type == "cpu"
                and tensors[0].device.type != "cpu")
    if name in SHAPE_READS:
        if name == "repeat_interleave":  # tensor repeats without output_size: the output size is a read
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        return True
    if name == "where":  # the one-argument form is nonzero
        return len(args) == 1 and not kwargs
    if name in ("__getitem__", "__setitem__"):
        return len(args) > 1 and _bool_index(args[1])
    return False


class _Mode(TorchFunctionMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not _SUSPENDED[0] and is_read(name, args, kwargs, self.reads.on_device):
            self.reads.add(name)
        return func(*args, **kwargs)


def _site() -> str:
    """The innermost frame of the project's code (``recsvc/...:line``) that made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        for root in _PACKAGE_ROOTS:
            idx = path.rfind(f"/{root}/")
            if idx >= 0 and "/host_reads.py" not in path:
                return f"{path[idx + 1:]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
