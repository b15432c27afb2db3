"""Building and loading pagellm's C kernels for the CPU: compiled on first use, cached, called via ctypes.

One library per instruction set holds the attention kernels (attention/csrc: paged_attention.c, decode attention
straight from the paged cache; prefill_attention.c, the causal attention of a step's prefill chunks, flash-style;
kv_write.c, the K/V writers; kv_format.h, the cache's element formats) and the layer kernels they run beside
(ops/csrc: cpu_ops.c, the fused RMSNorm with the residual add, SiLU-and-multiply and in-place rotary embedding;
linear_bf16.c, bfloat16 linear layers; moe_experts.c, the fused mixture-of-experts layer; decode_stack.c, a
whole decoder layer's decode step in one call; largest.c, each row's largest logits for the sampler), since
decode_stack.c calls the others directly. vec.h holds the
vector helpers all of them use, over the width header of the instruction set built for (vec_avx512.h,
vec_avx2.h, vec_generic.h); amx_tiles.h the AMX tile helpers. The other kernel libraries (GGUF, W8A8, AWQ/GPTQ,
LoRA, MLA) are built by the same machinery (`build_library`, `compiler_flags`).

The instruction set is chosen from this CPU's flags (`best_isa`): "avx512" (16-float vectors, and
avx512_bf16's rounding instruction where present), "avx2" (8-float vectors with FMA) or "generic" (no
-march: 4-float vectors the compiler maps onto the target's baseline, so it builds on any CPU).
PAGELLM_CPU_ISA=avx512|avx2|generic forces one (tests use it to run every path the machine can).

Compiling needs only a C compiler (cc/gcc) and takes about a second; the shared object is cached under
pagellm's cache directory, keyed by the source, the flags, the compiler and this CPU, so later starts just
load it. Where there is no compiler, or PAGELLM_NATIVE_KERNELS=0 is set, `native_library()` returns None, the
kernel wrappers built on it (attention/native.py, ops/cpu_ops.py, ops/linear_bf16.py) do too, and the model runs
on torch ops, which stay the reference the kernels are tested against.

The library is built with -fopenmp and loaded after torch: the dynamic linker resolves its libgomp.so.1
to the copy torch already loaded, so the kernel runs on torch's OpenMP thread pool with torch's
thread count rather than starting a second pool that would fight it for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

from pagellm.cache_dir import cache_root
from pagellm.cpu_features import cpu_flags, cpu_has_amx_bf16

logger = logging.getLogger(__name__)

_OPS_CSRC = pathlib.Path(__file__).with_name("csrc")
_ATTENTION_CSRC = pathlib.Path(__file__).parent.parent / "attention" / "csrc"
SOURCES = [*(_ATTENTION_CSRC / name for name in ("paged_attention.c", "prefill_attention.c", "kv_write.c")),
           *(_OPS_CSRC / name for name in ("cpu_ops.c", "linear_bf16.c", "moe_experts.c", "decode_stack.c",
                                           "largest.c"))]
# The vector helpers, which every library built on them (the MLA kernel's too) includes.
VEC_HEADERS = [_OPS_CSRC / name for name in ("vec.h", "vec_avx512.h", "vec_avx2.h", "vec_generic.h")]
# The cache's element formats, read by the attention kernels, the K/V writers and the decode stack.
KV_FORMAT_HEADER = _ATTENTION_CSRC / "kv_format.h"
# The AMX tile helpers, which the 8-bit kernels' library (ops/w8a8_kernels.py) includes too.
AMX_HEADER = _OPS_CSRC / "amx_tiles.h"
_HEADERS = [*VEC_HEADERS, KV_FORMAT_HEADER, AMX_HEADER]

# No -ffast-math: the kernel is vectorised by hand, and its summation order and exp must stay as written.
_COMMON_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-fno-math-errno", "-fno-trapping-math"]

ISAS = ("avx512", "avx2", "generic")

# Per instruction set: the /proc/cpuinfo flags it needs and the compiler flags that target them. AVX-512
# takes avx512_bf16's instructions only where the CPU has them (the header falls back to integer rounding).
_ISA_CPU_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"),
    "avx2": ("avx2", "fma"),
    "generic": (),
}

# A row threshold no call reaches: the kernels' tile paths switched off.
NEVER_ROWS = 1 << 62

_ISA_COMPILER_FLAGS = {
    "avx512": ["-DPAGELLM_ISA_AVX512", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq"],
    "avx2": ["-DPAGELLM_ISA_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}

_INT = ctypes.c_int
# What the kernels read and write: float32, or bfloat16 rounded as torch rounds it.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The instruction sets this CPU can run, widest first ("generic" always)."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISAS if all(flag in flags for flag in _ISA_CPU_FLAGS[isa])]


def best_isa() -> str:
    """PAGELLM_CPU_ISA if set (checked against the CPU), else the widest this CPU runs."""
    forced = os.environ.get("PAGELLM_CPU_ISA")
    if not forced:
        return runnable_isas()[0]
    if forced not in ISAS:
        raise ValueError(f"PAGELLM_CPU_ISA={forced!r} is not an instruction set; use one of {ISAS} or unset it")
    if forced not in runnable_isas():
        raise ValueError(f"PAGELLM_CPU_ISA={forced!r} needs CPU flags {_ISA_CPU_FLAGS[forced]}, which this CPU lacks; "
                         f"it runs {runnable_isas()}")
    return forced


def compiler_flags(isa: str, native_bf16: bool | None = None, amx: bool | None = None) -> list[str]:
    """Flags that build the kernels for `isa` (without -shared/-o), with avx512_bf16's instructions if
    `native_bf16`, and AMX's bfloat16 tiles besides if `amx` (defaults: if this CPU has them); usable on any
    machine to compile-check."""
    flags = list(_ISA_COMPILER_FLAGS[isa])
    if native_bf16 is None:
        native_bf16 = "avx512_bf16" in cpu_flags()
    if amx is None:
        amx = cpu_has_amx_bf16()
    if isa == "avx512" and native_bf16:
        flags.append("-mavx512bf16")
        if amx:
            flags += ["-mamx-tile", "-mamx-bf16"]
    return _COMMON_FLAGS + flags


def library_isa(library: ctypes.CDLL) -> str:
    """The instruction set a built library targets, as it reports it."""
    library.pagellm_isa.restype = ctypes.c_char_p
    return library.pagellm_isa().decode()


def amx_bf16_ready(library: ctypes.CDLL) -> bool:
    """Whether `library` was built with AMX's bfloat16 tiles and this process may use them: one answer for its
    linear, decode and prefill kernels, which share the build's flags (vec_avx512.h's HAVE_AMX_BF16)."""
    library.linear_bf16_amx_ready.restype = _INT
    return bool(ctypes.c_int.in_dll(library, "pagellm_linear_bf16_amx_available").value
                and library.linear_bf16_amx_ready())


@functools.cache
def native_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels compiled for `isa` (default: `best_isa()`), or None where they cannot be built or are
    switched off (torch ops then)."""
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        return None
    isa = isa or best_isa()
    try:
        return ctypes.CDLL(str(_build(isa)))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        logger.warning("native CPU kernels unavailable (%s); using torch ops", _first_line(error))
        return None


def find_compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    return compiler


def _build(isa: str) -> pathlib.Path:
    return build_library(f"pagellm_cpu_{isa}", SOURCES, _HEADERS, compiler_flags(isa))


def build_library(name: str, sources: list[pathlib.Path], headers: list[pathlib.Path],
                  flags: list[str]) -> pathlib.Path:
    """`sources` compiled with `flags` into a shared object under pagellm's cache directory, named `name` plus a
    key of the sources, `headers` (what they include), flags, compiler and CPU; built only where it is missing."""
    compiler = find_compiler()
    flags = flags + ["-shared"]
    contents = [source.read_bytes() for source in sources + headers]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([*contents, " ".join(flags).encode(), version.encode(), _cpu_identity()]))
    target = cache_root() / "kernels" / f"{name}-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile next to the target and rename: concurrent engines never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = pathlib.Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, compiler, stderr=result.stderr)
        os.replace(built, target)
    logger.info("compiled the native CPU kernels %s: %s", name, target)
    return target


def _cpu_identity() -> bytes:
    """The flags decide which instructions the build may use: the cache key includes them."""
    flags = " ".join(sorted(cpu_flags())) or platform.processor() + platform.machine()
    return flags.encode()


def _first_line(error: Exception) -> str:
    detail = getattr(error, "stderr", None) or str(error)
    return detail.strip().splitlines()[0] if detail.strip() else type(error).__name__


# The arrays expert_arrays made last, with the lists they were made from (held, so that their identity holds).
_last_expert_arrays: tuple[list[int], list[int], ctypes.Array, ctypes.Array] | None = None


def expert_arrays(experts: list[int], sizes: list[int]) -> tuple[ctypes.Array, ctypes.Array]:
    """A step's experts and their row counts as the C experts calls read them (int32 ids, int64 counts). A MoE
    layer passes the same two lists to its gate/up call and then its down call: the second gets the arrays the
    first made (the lists are the step's own and not changed after)."""
    global _last_expert_arrays
    last = _last_expert_arrays
    if last is not None and last[0] is experts and last[1] is sizes:
        return last[2], last[3]
    count = len(experts)
    ids, counts = (ctypes.c_int32 * count)(*experts), (ctypes.c_int64 * count)(*sizes)
    _last_expert_arrays = (experts, sizes, ids, counts)
    return ids, counts
