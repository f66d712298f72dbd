"""The fast forward's transformer layers as compiled graphs (inductor's CPU backend), called without Dynamo.

``recsvc.engine.kernels.fast.FastLlama`` already runs a fixed, small number of ops per layer; what remains of a
forward's fixed cost is the dispatch of those ops (~14 per layer, each a Python call into an ATen kernel) and
the elementwise passes between the matmuls (RMSNorm, rotary, SiLU * up, the residual adds), each reading and
writing its tensor once more. ``CompiledLayers`` is the same layer stack as a ``torch.nn.Module``; inductor
turns it into one graph: the elementwise work fused into a few C++ loops around the matmuls, the graph run
from one call, the weights frozen into it (``freezing``: constants, linear weights pre-packed for oneDNN).

``ExportedGraphs`` builds two graphs, one for prompt prefills (``keep`` given) and one for every other forward
(decode steps, tree verification), each captured once by ``torch.export`` with every size dynamic (requests B,
new tokens q, cache width S and capacity C, from 1 up) and compiled by ``torch._inductor.compile``. The engine
picks the graph itself and calls it directly: no ``torch.compile`` wrapper, so no guard evaluation, no cache
lookup among specialised graphs, no frame hooks per call (measured on the `small` target, one CPU thread: that
machinery cost 0.2-0.4 ms per forward, 1-1.5 ms of a request's four).

Cost: each graph compiles on its first call (10-20 s each on one CPU core; ``recsvc serve --forward compiled``
pays it at start-up in ``BundleRecommender.warm_up``), and the compiler needs a C++ toolchain (``g++``). CPU
only (fp32 and bf16 models), like the fast forward it compiles.

Numerics: the same arithmetic as ``FastLlama.forward`` (the one layer, ``recsvc.engine.kernels.layer.slot_layer``);
inductor's fused loops and its packed matmuls sum in their own order, so bits differ from the uncompiled path by
float rounding, the tolerance the fast path already documents (tested: the same items as the fast forward with
scores within 1e-4, strict speculation == plain beam search, and the user-state cache's outputs identical with
and without it). A row's result does not depend on the other rows of its call (what the bounded last step and
the user-state cache rely on): tested.

Shapes: B requests, q new tokens, S cache width after the call, C cache capacity, H hidden, h heads,
h_kv kv heads, d head dim, I intermediate size.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch.export import Dim

from recsvc.engine.kernels.fast import FastLlama
from recsvc.engine.kernels.layer import LayerShape, LayerWeights, slot_layer, weight_of
from recsvc.errors import UserError


def require_compiler() -> None:
    """A clear error, before any work, when no C++ compiler is on the PATH (inductor's CPU backend needs one:
    ``$CXX``, ``g++`` or ``clang++``)."""
    found = [c for c in (os.environ.get("CXX"), "g++", "clang++") if c and shutil.which(c)]
    if not found:
        raise UserError("the compiled forward (--forward compiled) needs a C++ compiler (g++ or clang++, or $CXX) "
                        "on the PATH; none was found: install one or use --forward fast")


class ExportedGraphs:
    """``CompiledLayers`` compiled ahead of its calls, one graph per kind of call (with / without ``keep``),
    each built on the kind's first call and then called directly (see the module's docstring). Thread-safe: a
    graph compiles once even when two threads need it at the same time."""

    def __init__(self, module: CompiledLayers) -> None:
        self.module = module
        self._graphs: dict[bool, CompiledGraph] = {}
        self._lock = threading.Lock()

    @property
    def compiled(self) -> list[str]:
        """The kinds of call compiled so far: "prefill" (with ``keep``) and / or "other"."""
        return sorted("prefill" if kind else "other" for kind in self._graphs)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor,
                 slots: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                 keep: torch.Tensor | None = None) -> torch.Tensor:  # CompiledLayers.forward's inputs / output
        kind = keep is not None
        graph = self._graphs.get(kind)
        if graph is None:
            with self._lock:  # another thread may have compiled it meanwhile
                graph = self._graphs.get(kind)
                if graph is None:
                    graph = self._graphs[kind] = self._compile(kind)
        # the graphs were traced on contiguous inputs (an expanded view, stride 0, must be materialised); the
        # caches are written in place, so they must be the caller's own contiguous buffers
        assert all(t.is_contiguous() for t in keys + values), "KV buffers must be contiguous"
        args = [hidden.contiguous(), cos.contiguous(), sin.contiguous(), visible.contiguous(), slots.contiguous(),
                keys, values] + ([keep.contiguous()] if kind else [])
        return graph(*args)

    def _compile(self, keep: bool) -> CompiledGraph:
        """Export the kind's graph from example inputs of small, pairwise distinct sizes (so that no size is
        assumed equal to another or to 1), every size dynamic, then compile it."""
        m = self.module
        weight = m.norm
        b, q, s, c = 3, 5, 37, 101
        dt, dev = weight.dtype, weight.device
        args: tuple = (
            torch.zeros(b, q, m.hidden, dtype=dt, device=dev), torch.zeros(b, q, 1, m.d, dtype=dt, device=dev),
            torch.zeros(b, q, 1, m.d, dtype=dt, device=dev), torch.ones(b, q, s, dtype=torch.bool, device=dev),
            (s - q + torch.arange(q, device=dev))[None].expand(b, q).contiguous(),
            [torch.zeros(b, m.hkv, c, m.d, dtype=dt, device=dev) for _ in m.qkv],
            [torch.zeros(b, m.hkv, c, m.d, dtype=dt, device=dev) for _ in m.qkv])
        B, Q, S, C = Dim("b", min=1), Dim("q", min=1), Dim("s", min=1), Dim("c", min=1)
        shapes: tuple = ({0: B, 1: Q}, {0: B, 1: Q}, {0: B, 1: Q}, {0: B, 1: Q, 2: S}, {0: B, 1: Q},
                         [{0: B, 2: C}] * len(m.qkv), [{0: B, 2: C}] * len(m.qkv))
        if keep:
            args += (torch.full((b, 1), q - 1, dtype=torch.long, device=dev),)
            shapes += ({0: B},)
        return export_and_compile(m, args, shapes)


def export_and_compile(module: torch.nn.Module, args: tuple, shapes: tuple) -> CompiledGraph:
    """``module`` captured by ``torch.export`` on example ``args`` (tensors or lists of tensors) with the
    ``dynamic_shapes`` ``shapes``, compiled by inductor with frozen weights and a C++ wrapper; the result is
    called with arguments of the same structure (``CompiledGraph``)."""
    with torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(module, args, dynamic_shapes=shapes)
        with inductor_config.patch(freezing=True, cpp_wrapper=True):
            wrapped = torch._inductor.compile(program.module(), _flat(args))
    return CompiledGraph.of(wrapped, args)


class CompiledGraph:
    """An exported, compiled graph, called with the module's arguments (a list argument as a list).

    ``torch._inductor.compile`` returns the compiled kernel inside Python wrappers run on every call: the pytree
    flattening of the arguments, Dynamo's disable context, AOTAutograd's runtime wrapper (grad mode, autocast,
    version counters of mutated inputs) and freezing's argument filter, which drops the frozen weights from the
    argument list. For an inference call on plain tensors they change nothing, and together they cost about 60
    us per call (measured on the Beauty target's decode graph, fp32, one thread: 2.45 against 2.39 ms at 20 rows),
    and a request makes eight such calls. So ``of`` finds the kernel itself (the inner ``CompiledFxGraph`` that
    freezing's filter calls, with the positions of the arguments it keeps) and uses it when the filter keeps
    exactly the caller's tensors, in order, and a probe call on random inputs gives the wrapped call's outputs
    and in-place writes bit for bit. Otherwise (another torch version, a graph that drops an input) it calls the
    wrapped graph: ``direct`` says which.
    """

    def __init__(self, wrapped: Callable[..., object], kernel: Callable[[list], list] | None, single: bool) -> None:
        self.wrapped = wrapped
        self.kernel = kernel  # the inner compiled kernel: flat tensor list -> list of outputs
        self.single = single  # the module returns one tensor (else a tuple)

    @property
    def direct(self) -> bool:
        return self.kernel is not None

    def __call__(self, *args: torch.Tensor | list[torch.Tensor]):
        if self.kernel is None:
            return self.wrapped(*args)
        outs = self.kernel(_flat(args))
        return outs[0] if self.single else tuple(outs)

    @classmethod
    def of(cls, wrapped: Callable[..., object], args: tuple) -> CompiledGraph:
        """``wrapped`` (``torch._inductor.compile``'s result for example ``args``), called directly when its
        kernel can be (see the class)."""
        kernel = _inner_kernel(wrapped, len(_flat(args)))
        if kernel is None:
            return cls(wrapped, None, True)
        with torch.inference_mode():
            first, second = _probe_args(args, seed=0), _probe_args(args, seed=0)
            expected = wrapped(*first)
            single = isinstance(expected, torch.Tensor)
            graph = cls(wrapped, kernel, single)
            got = graph(*second)
            outs = (expected,) if single else tuple(expected)
            mine = (got,) if single else tuple(got)
            same = (len(outs) == len(mine) and all(torch.equal(x, y) for x, y in zip(outs, mine, strict=True))
                    and all(torch.equal(x, y) for x, y in zip(_flat(first), _flat(second), strict=True)))
        return graph if same else cls(wrapped, None, True)


def _flat(args: tuple) -> list[torch.Tensor]:
    """A graph's arguments as the flat tensor list its kernel takes (a list argument as its tensors, in order)."""
    return [t for a in args for t in (a if isinstance(a, list) else [a])]


def _probe_args(args: tuple, seed: int) -> tuple:
    """Copies of example ``args``: floating tensors filled with seeded normal values (so that a swapped argument
    shows), the others (indices, masks) as they are."""
    gen = torch.Generator().manual_seed(seed)

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(dtype=t.dtype, device=t.device)
        return t.clone()

    return tuple([one(t) for t in a] if isinstance(a, list) else one(a) for a in args)


def _inner_kernel(wrapped: Callable[..., object], n_inputs: int) -> Callable[[list], list] | None:
    """The compiled kernel inside ``torch._inductor.compile``'s result (freezing's argument filter's
    ``optimized_function``) when the filter keeps exactly the last ``n_inputs`` arguments (the caller's tensors,
    in order, after the frozen weights); None when it cannot be found or does something else."""
    seen: set[int] = set()
    todo: list[object] = [wrapped]
    while todo:
        fn = todo.pop()
        if id(fn) in seen or not callable(fn):
            continue
        seen.add(id(fn))
        if getattr(fn, "__qualname__", "").startswith("fw_compiler_freezing."):
            cells = _cells(fn)
            kernel, keep = cells.get("optimized_function"), cells.get("preserved_arg_indices")
            offsets, last = cells.get("unwrapped_args_offsets"), cells.get("max_offset_idx")
            if kernel is None or keep is None or offsets is None or last is None or len(keep) != n_inputs:
                return None
            if list(keep) != list(range(keep[0], keep[0] + n_inputs)) or any(offsets[min(i, last)] for i in keep):
                return None
            return kernel
        todo.extend(v for v in (getattr(fn, "__wrapped__", None), *_cells(fn).values()) if v is not None)
    return None


def _cells(fn: object) -> dict[str, object]:
    """A function's closure as {free variable name: value} (empty cells left out)."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, closure, strict=False):
        try:
            out[name] = cell.cell_contents
        except ValueError:
            continue
    return out


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    """``t`` as a constant of the module (its storage shared, not copied)."""
    return torch.nn.Parameter(t.detach(), requires_grad=False)


class CompiledLayers(torch.nn.Module):
    """The decoder layers (``recsvc.engine.kernels.layer.slot_layer``, the one layer) + the final norm over a
    caller-owned KV cache (``recsvc.engine.kernels.fast.FastCache``'s buffers), as ``FastLlama.forward`` runs them,
    on that forward's fused weights as constants of the module (compiled by ``ExportedGraphs``; ``compiled_layers``
    builds both)."""

    def __init__(self, fast: FastLlama) -> None:
        super().__init__()
        self.shape: LayerShape = fast.shape
        self.h, self.hkv, self.d = fast.shape.heads, fast.shape.kv_heads, fast.shape.head_dim
        self.hidden = fast.shape.hidden
        self.eps = [float(w.eps1) for w in fast.layers]
        self.eps2 = [float(w.eps2) for w in fast.layers]
        self.norm_eps = float(fast.norm_eps)

        def weights(field: str) -> torch.nn.ParameterList:  # one projection / norm of every layer
            return torch.nn.ParameterList([_frozen(weight_of(getattr(w, field))) for w in fast.layers])

        self.n1, self.qkv, self.o = weights("norm1"), weights("qkv"), weights("o")
        self.n2, self.gate_up, self.down = weights("norm2"), weights("gate_up"), weights("down")
        last = fast.layers[-1] if fast.layers else None  # the last layer's q and k / v apart (``keep``)
        self.last_q = _frozen(weight_of(last.q)) if last is not None and last.q is not None else None
        self.last_kv = _frozen(weight_of(last.kv)) if last is not None and last.kv is not None else None
        self.norm = _frozen(fast.norm)
        self.eval()

    def forward(
        self,
        hidden: torch.Tensor,  # [B, q, H] the new tokens' embeddings
        cos: torch.Tensor,  # [B, q, 1, d]
        sin: torch.Tensor,  # [B, q, 1, d]
        visible: torch.Tensor,  # [B, q, S] bool
        slots: torch.Tensor,  # [B, q] cache slots the tokens' keys / values go to
        keys: list[torch.Tensor],  # per layer [B, h_kv, C, d] (C >= S), written in place
        values: list[torch.Tensor],  # per layer [B, h_kv, C, d]
        keep: torch.Tensor | None = None,  # [B, r] the tokens whose outputs are wanted (the last layer's pruning)
    ) -> torch.Tensor:  # [B, q, H] (or [B, r, H] with ``keep``) after the final norm
        last = len(self.qkv) - 1
        for i in range(len(self.qkv)):
            w = LayerWeights(self.n1[i], self.eps[i], self.qkv[i], self.o[i], self.n2[i], self.eps2[i],
                             self.gate_up[i], self.down[i], self.last_q if i == last else None,
                             self.last_kv if i == last else None)
            hidden = slot_layer(self.shape, w, hidden, cos, sin, slots, visible, keys[i], values[i],
                                keep if i == last else None)
        return F.rms_norm(hidden, (self.hidden,), self.norm, self.norm_eps)


def compiled_layers(fast: FastLlama) -> Callable[..., torch.Tensor]:
    """``FastLlama``'s ``compile_layers`` (the compile-the-stack strategy): its layer stack as compiled graphs."""
    return ExportedGraphs(CompiledLayers(fast))
