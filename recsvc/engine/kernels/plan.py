"""The forward plan: how the engine runs a model's forwards, resolved once from the user's flags.

One frozen ``ForwardPlan`` per model says everything the engine and its callers need to know about its forwards:
which forward computes (``kernel``), whether attention is exact (``generate``'s bits), whether shapes are
bucketed over a static KV cache (``static``: the searches then avoid host reads), whether each bucket and plain
step is captured as a CUDA graph (``capture``) and what is compiled (``compile``). The searches, the drafters
and the service read these fields; no code below the CLI compares forward names.

The flag values (``--forward``) are one table, ``FORWARDS``; every ``choices`` list is built from it.
``resolve`` turns (``--forward``, ``--attention``, the model's device, what the model supports) into a plan, or
raises ``UserError`` for a contradiction, never a silent fallback (``--attention exact --forward fast`` once ran
non-exact, ``--forward compiled`` on a GPU once ran the lean forward). ``auto`` resolves to a preset per hardware:

| hardware                                  | preset         | plan                                        |
| ----------------------------------------- | -------------- | ------------------------------------------- |
| any, ``--attention exact``                | ``reference``  | lean: transformers' kernels, their bits     |
| CPU (fp32, or bf16 with AVX512-BF16 / AMX) | ``cpu``        | fast: one masked SDPA per layer, packed     |
|                                           |                | linears                                     |
| CPU, ``--forward compiled``               | ``compiled-cpu`` | fast, the layer stack one inductor graph  |
| CUDA GPU                                  | ``gpu``        | fast, bucketed over a static KV cache, each |
|                                           |                | bucket and plain step a CUDA graph          |

(A CPU without native bf16 serves fp32 weights, ``--dtype auto``; the plan is the same ``cpu`` one.) Torch-free:
the CLI builds its flags from it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from recsvc.errors import UserError

Kernel = Literal["transformers", "lean", "fast"]
Compile = Literal["", "stack", "layer"]
ATTENTIONS = ("fp32", "exact")


@dataclass(frozen=True)
class ForwardPlan:
    name: str  # what the plan is called in reports (the flag it realises on this device)
    # "transformers" (its own forward), "lean" (its kernels, bit for bit), "fast" (recsvc.engine.kernels.fast)
    kernel: Kernel
    attention: str  # "exact" (generate's bits) or "fp32" (the generated tokens' attention split, in fp32)
    device: str  # the model's device type: "cpu", "cuda", ...
    static: bool = False  # bucketed, padded shapes over a static KV cache (recsvc.engine.kernels.buckets): no host read
    capture: bool = False  # each bucket's forward and each plain step a CUDA graph (recsvc.engine.kernels.cuda_graphs)
    compile: Compile = ""  # "stack": the layers one inductor graph (CPU); "layer": each layer a torch.compile graph

    @property
    def exact(self) -> bool:
        """The engine reproduces transformers' ``generate`` bit for bit."""
        return self.attention == "exact"

    @property
    def fast(self) -> bool:
        """The fast forward computes (callers build one visibility mask per forward: ``forward_masked``)."""
        return self.kernel == "fast"

    @property
    def sync_free(self) -> bool:
        """Searches avoid host reads where a static bound does instead (a verification fed at its bound, no cache
        compaction, the replay's fixed depth count): the static shapes' forwards."""
        return self.static

    @property
    def compiled_scoring(self) -> bool:
        """Plain beam search scores its steps with one compiled graph (``recsvc.engine.kernels.compiled_scoring``)."""
        return self.compile == "stack"

    @property
    def step_graphs(self) -> bool:
        """A plain step's LM head and selection run as one function of tensors (a graph replay when captured)."""
        return self.static and not self.compiled_scoring

    @property
    def prepares(self) -> bool:
        """Something is compiled or captured on first use: a server warms it up before it serves."""
        return bool(self.compile) or self.capture


@dataclass(frozen=True)
class Forward:
    """One value of ``--forward``: what it asks for, and its help line."""

    kernel: Kernel
    static: bool = False
    capture: bool = False  # on CUDA; elsewhere the same plan uncaptured (named by what it is: "bucketed")
    compile: Compile = ""
    help: str = ""


FORWARDS: dict[str, Forward | None] = {  # None: resolved per hardware
    "auto": None,
    "fast": Forward("fast", help="few ops per layer, one masked attention per layer (CPU; eager on a GPU)"),
    "compiled": Forward("fast", compile="stack",
                        help="the fast forward's layers exported and compiled by inductor at start-up (CPU, needs a "
                             "C++ compiler, ~20-40 s more start-up)"),
    "lean": Forward("lean", help="transformers' kernels without its overhead (bit-identical with --attention exact)"),
    "bucketed": Forward("fast", static=True,
                        help="the fast forward at bucketed shapes over a static KV cache, sync-free rounds"),
    "graphs": Forward("fast", static=True, capture=True,
                      help="bucketed, each bucket a CUDA graph captured at start-up (CUDA; elsewhere bucketed)"),
    "compiled-graphs": Forward("fast", static=True, capture=True, compile="layer",
                               help="graphs with each decoder layer compiled by torch.compile"),
}
FORWARD_NAMES = tuple(FORWARDS)  # the --forward choices of the commands that serve


def forward_names(*, static: bool | None = None, compiled: bool | None = None) -> tuple[str, ...]:
    """The fast forward's ``--forward`` values (a bench's choices), those with / without static shapes and a
    compile strategy when asked; from the one table."""
    return tuple(name for name, f in FORWARDS.items() if f is not None and f.kernel == "fast"
                 and (static is None or f.static == static) and (compiled is None or bool(f.compile) == compiled))


def forward_help() -> str:
    """The ``--forward`` help text, from the table."""
    parts = [f"{name}: {f.help}" for name, f in FORWARDS.items() if f is not None]
    return ("engine forward (docs/ARCHITECTURE.md, the forward plan per hardware). auto: graphs on a CUDA GPU, fast "
            "on a CPU, where the model allows; lean with --attention exact. " + "; ".join(parts))


# the named presets (``auto`` picks one per hardware; each is also what a flag resolves to there)
def reference(device: str = "cpu") -> ForwardPlan:
    """Exact attention over transformers' kernels: ``generate``'s bits (tests, ``--attention exact``)."""
    return ForwardPlan("lean", "lean", "exact", device)


def cpu() -> ForwardPlan:
    """A CPU, fp32 or bf16 weights: the fast forward."""
    return ForwardPlan("fast", "fast", "fp32", "cpu")


def compiled_cpu() -> ForwardPlan:
    """A CPU with a C++ compiler, start-up time to spend: the fast forward's layer stack one inductor graph."""
    return ForwardPlan("compiled", "fast", "fp32", "cpu", compile="stack")


def gpu(device: str = "cuda") -> ForwardPlan:
    """A CUDA GPU: the fast forward at bucketed shapes, every bucket and plain step a CUDA graph."""
    return ForwardPlan("graphs", "fast", "fp32", device, static=True, capture=True)


PRESETS = {"reference": reference(), "cpu": cpu(), "compiled-cpu": compiled_cpu(), "gpu": gpu()}


def check_flags(forward: str, attention: str) -> None:
    """The contradictions the flags alone show (UserError): an unknown value, or exact attention asked of a
    forward that is not exact."""
    if forward not in FORWARDS:
        raise UserError(f"--forward must be one of {', '.join(FORWARD_NAMES)}, got {forward!r}")
    if attention not in ATTENTIONS:
        raise UserError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    wanted = FORWARDS[forward]
    if attention == "exact" and wanted is not None and wanted.kernel != "lean":
        raise UserError(f"--attention exact reproduces transformers' generate bit for bit, which --forward {forward} "
                        "does not (it rounds differently); use --forward lean or auto with --attention exact, or "
                        "--attention fp32")


def resolve(forward: str, attention: str, device: str, lean_ok: bool, fast_ok: bool) -> ForwardPlan:
    """The plan for ``--forward`` / ``--attention`` on a model on ``device`` ("cpu", "cuda", ...): ``lean_ok``:
    the lean forward supports the model (a plain ``LlamaForCausalLM``); ``fast_ok``: so does the fast forward (and
    its dtype: fp32 or bf16). ``auto`` picks the preset of the hardware that applies; an explicit value the model
    or the device cannot run is a UserError."""
    check_flags(forward, attention)
    cuda = device == "cuda"
    wanted = FORWARDS[forward]
    if wanted is None:  # auto: the hardware's preset, where the model and the attention allow it
        if attention == "fp32" and fast_ok and device in ("cpu", "cuda"):
            return gpu(device) if cuda else cpu()
        if lean_ok:
            return ForwardPlan("lean", "lean", attention, device)  # with exact attention: the reference preset
        return ForwardPlan("transformers", "transformers", attention, device)
    if wanted.kernel == "lean" and not lean_ok:
        raise UserError(f"--forward {forward} runs plain LLaMA models only (LlamaForCausalLM, SiLU MLP, no biases); "
                        "use --forward auto")
    if wanted.kernel == "fast" and not fast_ok:
        raise UserError(f"--forward {forward} runs plain LLaMA models in fp32 or bf16 only; use --forward auto or "
                        "lean")
    if wanted.compile == "stack" and device != "cpu":
        raise UserError(f"--forward {forward} compiles for a CPU (inductor's C++ backend); the model is on {device}: "
                        "use --forward graphs or compiled-graphs there")
    capture = wanted.capture and cuda
    name = forward if capture or not wanted.capture else ("compiled-bucketed" if wanted.compile else "bucketed")
    return ForwardPlan(name, wanted.kernel, attention, device, static=wanted.static, capture=capture,
                       compile=wanted.compile)
