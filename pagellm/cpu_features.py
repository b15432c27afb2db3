"""What this CPU computes natively: decides the default dtype and how half-precision matmuls run."""

from __future__ import annotations

import functools

import torch

# /proc/cpuinfo flags that mean hardware dot products in each half type (AVX512/AMX/AVX-NE-CONVERT).
_NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "avx_ne_convert"),
    torch.float16: ("avx512_fp16", "amx_fp16", "avx_ne_convert"),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# The flags of AMX's bfloat16 tiles: the tile registers and their bfloat16 product.
AMX_BF16_FLAGS = frozenset({"amx_tile", "amx_bf16"})


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX's bfloat16 tiles (the kernels and oneDNN's GEMM and attention run on them)."""
    return AMX_BF16_FLAGS <= cpu_flags()


# The flags that decide which CPU kernels and dtypes run fast; benchmarks print them beside their figures.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@functools.cache
def cpu_model_name() -> str:
    """/proc/cpuinfo's model name ('unknown CPU' where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


@functools.cache
def cpu_family_model() -> str:
    """/proc/cpuinfo's 'cpu family F model M' (x86: the same model name can be CPUs of different generations, whose
    figures differ), or '' where it has none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():  # the first processor's block is enough
                    break
    except OSError:
        pass
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"cpu family {fields['cpu family']} model {fields['model']}"


def cpu_description() -> str:
    """Model name, family and model, and the speed-relevant flags present, e.g. 'AMD EPYC ... (cpu family 25
    model 17; avx2 avx512f avx512_bf16)'."""
    present = " ".join(flag for flag in SPEED_FLAGS if flag in cpu_flags()) or "none of " + ", ".join(SPEED_FLAGS)
    family = cpu_family_model()
    return f"{cpu_model_name()} ({family + '; ' if family else ''}{present})"


@functools.cache
def cpu_has_native(dtype: torch.dtype) -> bool:
    """True for float32, and for a half type only where the CPU has instructions for it (asked per
    attention call, hence cached)."""
    if dtype == torch.float32:
        return True
    return any(flag in cpu_flags() for flag in _NATIVE_FLAGS.get(dtype, ()))
