"""What the running hardware does fast: native bf16 or not, and a one-line description for benchmark reports.

bf16 is only fast where the hardware computes it: CUDA GPUs with bf16, and CPUs with AVX512-BF16 or AMX.
Elsewhere (AVX2-only CPUs, AVX-512 without BF16) torch emulates it and it is ~1.5x slower than fp32, so the
"auto" precision picks fp32 there. Every timing the product reports carries ``describe()``.
"""

from __future__ import annotations

import platform
from functools import cache

DEVICES = ("cpu", "cuda")  # where a command runs its models (--device)


def native_bf16(device: str = "cpu") -> bool:
    import torch

    if str(device).startswith("cuda"):
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:  # private helpers of torch.cpu; absent -> assume no native bf16
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """"auto" -> "bf16" where it is native on ``device``, else "fp32"; other names pass through."""
    if name != "auto":
        return name
    return "bf16" if native_bf16(device) else "fp32"


@cache
def cpu_flags() -> list[str]:
    """The vector-ISA flags that decide inference speed (from /proc/cpuinfo; [] where unreadable)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe(device: str = "cpu", dtype: str | None = None) -> dict[str, object]:
    """{"device", "cpu", "cpu_flags", "native_bf16", "dtype"}: stored beside every benchmark figure."""
    import torch

    out: dict[str, object] = {"device": str(device), "cpu": cpu_model(), "cpu_flags": cpu_flags(),
                              "native_bf16": native_bf16(device), "torch_threads": torch.get_num_threads()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    if dtype is not None:
        out["dtype"] = resolve_dtype(dtype, device)
    return out


def machine() -> str:
    """One line for benchmark reports: CPU model, the vector-ISA flags that decide speed, threads, GPU, torch."""
    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    flags = " ".join(cpu_flags()) or "no AVX flags read"
    return (f"{cpu_model()} [{flags}; native bf16: {'yes' if native_bf16() else 'no'}], "
            f"{torch.get_num_threads()} threads, {dev}, torch {torch.__version__}")
