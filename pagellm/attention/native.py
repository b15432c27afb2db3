"""pagellm's C kernels for the CPU: compiled on first use, cached, called via ctypes.

csrc/paged_attention.c is decode attention straight from the paged cache (float32 or bfloat16 queries;
float32, bfloat16 or quantized caches; float32 arithmetic, optional sliding window); csrc/prefill_attention.c
the causal attention of a step's prefill chunks from the same cache, flash-style; csrc/cpu_ops.c holds the
fused RMSNorm (with the residual add), SiLU-and-multiply and in-place rotary embedding in float32 and bfloat16,
and the K/V writers; csrc/kv_format.h the cache's element formats (kv_spec.py's KVCacheFormat: reading codes
in registers, quantizing rows as they are written); csrc/vec.h the vector helpers all use, over the width
header of the instruction set built for (vec_avx512.h, vec_avx2.h, vec_generic.h).

The instruction set is chosen from this CPU's flags (`best_isa`): "avx512" (16-float vectors, and
avx512_bf16's rounding instruction where present), "avx2" (8-float vectors with FMA) or "generic" (no
-march: 4-float vectors the compiler maps onto the target's baseline, so it builds on any CPU).
PAGELLM_CPU_ISA=avx512|avx2|generic forces one (tests use it to run every path the machine can).

Compiling needs only a C compiler (cc/gcc) and takes about a second; the shared object is cached under
pagellm's cache directory, keyed by the source, the flags, the compiler and this CPU, so later starts just
load it. Where there is no compiler, or PAGELLM_NATIVE_KERNELS=0 is set, `decode_kernel()`, `prefill_kernel()`
and `cpu_ops()` return None and the model runs on torch ops, which stay the reference the kernels are tested against.

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
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.cache_dir import cache_root
from pagellm.cpu_features import cpu_flags, cpu_has_amx_bf16

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("paged_attention.c", "prefill_attention.c", "cpu_ops.c", "linear_bf16.c",
                                        "moe_experts.c", "decode_stack.c")]
# The AMX tile helpers, which the 8-bit kernels' library (ops/w8a8_kernels.py) includes too.
AMX_HEADER = _CSRC / "amx_tiles.h"
_HEADERS = [*(_CSRC / name for name in ("vec.h", "vec_avx512.h", "vec_avx2.h", "vec_generic.h", "kv_format.h")),
            AMX_HEADER]
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
_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
# What the kernels read and write: float32, or bfloat16 rounded as torch rounds it.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# The cache formats the attention kernels read (kv_format.h): these dtypes, or any quantized format.
_KERNEL_FORMAT_NAMES = ("float32", "bfloat16")


def kernels_read(kv_format: KVCacheFormat) -> bool:
    """Whether the native attention kernels read caches of this format."""
    return kv_format.quantized or kv_format.name in _KERNEL_FORMAT_NAMES


def _cache_geometry(cache: torch.Tensor, head_dim: int, kv_format: KVCacheFormat | None) -> tuple[int, int, int]:
    """(format code, kv heads, block size) of one layer's cache [num_blocks, kv_heads, *run] of `kv_format`
    (None: unquantized, in the cache tensor's dtype), checked against the kernels' layout."""
    if kv_format is None or not kv_format.quantized:
        if cache.dim() != 4 or cache.dtype not in KERNEL_DTYPES or cache.shape[3] != head_dim:
            raise TypeError(f"the native kernels read float32 or bfloat16 caches [blocks, kv_heads, block_size, "
                            f"{head_dim}], not {cache.dtype} {tuple(cache.shape)}")
        return int(cache.dtype == torch.bfloat16), cache.shape[1], cache.shape[2]
    run = cache.shape[-1] if cache.dim() == 3 else 0
    if cache.dtype != torch.uint8 or run % (head_dim + 2):
        raise TypeError(f"a {kv_format.name} cache is uint8 runs [blocks, kv_heads, block_size * {head_dim + 2}], "
                        f"not {cache.dtype} {tuple(cache.shape)}")
    return kv_format.code, cache.shape[1], run // (head_dim + 2)


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


def _check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} here, not {tensor.dtype} (the activations, residual and norm "
                        f"weight share one dtype; rotary tables are float32, positions int64)")


def _checked_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Attention sinks as the kernels read them: contiguous float32 [num_heads] (None: no sinks)."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or sinks.device.type != "cpu":
        raise ValueError(f"sinks is {sinks.device} {tuple(sinks.shape)}; the kernels take one float32 logit per "
                         f"query head, [{num_heads}] on the CPU")
    return sinks.to(torch.float32).contiguous()


def amx_bf16_ready(library: ctypes.CDLL) -> bool:
    """Whether `library` was built with AMX's bfloat16 tiles and this process may use them: one answer for its
    linear, decode and prefill kernels, which share the build's flags (vec_avx512.h's HAVE_AMX_BF16)."""
    library.linear_bf16_amx_ready.restype = _INT
    return bool(ctypes.c_int.in_dll(library, "pagellm_linear_bf16_amx_available").value
                and library.linear_bf16_amx_ready())


class DecodeKernel:
    """paged_decode_attention with its argument types declared; see the C source for layouts.

    Queries may be float32 or bfloat16, caches float32, bfloat16 (each independently of q) or quantized
    (`kv_format`); the output has the query's dtype. bfloat16 queries over a bfloat16 cache run on AMX's tiles
    where the build and the OS allow them (`amx`; set it False for the vector loops) and block_size is a multiple
    of 16.
    """

    CACHE_DTYPES = KERNEL_DTYPES

    @staticmethod
    def supports(head_dim: int) -> bool:
        # The kernel sums values in 32-float pieces; other head sizes take the torch path.
        return head_dim % 32 == 0

    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = library_isa(library)
        self._function = library.paged_decode_attention
        self._function.restype = _INT
        self._function.argtypes = [_PTR, _PTR, _PTR, _INT, _INT, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                   _I64, _F32, _I64, _PTR, _INT]
        self.amx = amx_bf16_ready(library)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        scale: float,
        sliding_window: int = 0,
        kv_format: KVCacheFormat | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, kv_heads, block_size, head_dim], or runs of a
        quantized `kv_format` (kv_spec.py).

        sliding_window > 0: each sequence attends only its last sliding_window keys (0: all of them).
        sinks: None, or [num_heads] float32 logits each head's softmax denominator also holds."""
        query_dtype = q.dtype
        if query_dtype not in KERNEL_DTYPES:  # float16: computed from float32 and returned in float16
            q = q.to(torch.float32)
        q = q.contiguous()
        num_seqs, num_heads, head_dim = q.shape
        format_code, num_kv_heads, block_size = _cache_geometry(k_cache, head_dim, kv_format)
        if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
            raise TypeError(f"k_cache {k_cache.dtype} {tuple(k_cache.shape)} and v_cache {v_cache.dtype} "
                            f"{tuple(v_cache.shape)} differ")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache views must be contiguous for the native kernel")
        if block_tables.dtype != np.int64 or context_lens.dtype != np.int64:
            raise TypeError("block_tables and context_lens must be int64 arrays")
        if sliding_window < 0:
            raise ValueError(f"sliding_window={sliding_window} must be 0 (full attention) or a positive key count")
        block_tables = np.ascontiguousarray(block_tables)
        context_lens = np.ascontiguousarray(context_lens)
        sinks = _checked_sinks(sinks, num_heads)
        out = torch.empty_like(q)
        failed = self._function(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), format_code,
            int(q.dtype == torch.bfloat16), block_tables.ctypes.data, block_tables.shape[1], context_lens.ctypes.data,
            out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
            sinks.data_ptr() if sinks is not None else None, int(self.amx),
        )
        if failed == 1:
            raise MemoryError("the native decode-attention kernel could not allocate its score buffer")
        if failed:
            raise ValueError(f"head_dim={head_dim} is not a multiple of 32, which the native kernel needs")
        return out.to(query_dtype)


@dataclass(frozen=True)
class PrefillChunks:
    """A step's prefill chunks as the prefill kernel reads them, checked once per step (every layer reuses
    them): chunk c's queries are tokens query_starts[c] .. + query_lens[c] of the prefill part of the step,
    the last query_lens[c] positions of a sequence of seq_lens[c] tokens whose blocks are block_tables[c]."""

    block_tables: np.ndarray  # [chunks, table width] int64
    query_starts: np.ndarray  # [chunks] int64
    query_lens: np.ndarray
    seq_lens: np.ndarray
    tokens: int  # the prefill tokens the chunks reach
    max_seq_len: int

    @classmethod
    def build(cls, block_tables, query_starts, query_lens, seq_lens) -> PrefillChunks:
        tables, starts, lens, seq_lens = (np.ascontiguousarray(a, dtype=np.int64)
                                          for a in (block_tables, query_starts, query_lens, seq_lens))
        if tables.ndim != 2 or not (len(tables) == len(starts) == len(lens) == len(seq_lens)):
            raise ValueError(f"block_tables {tables.shape} needs one row per chunk of query_starts {starts.shape}, "
                             f"query_lens {lens.shape}, seq_lens {seq_lens.shape}")
        if not len(lens):
            return cls(tables, starts, lens, seq_lens, 0, 0)
        if (lens < 1).any() or (seq_lens < lens).any() or (starts < 0).any():
            raise ValueError("every chunk needs query_start >= 0 and 1 <= query_len <= seq_len")
        return cls(tables, starts, lens, seq_lens, int((starts + lens).max()), int(seq_lens.max()))


class PrefillKernel:
    """paged_prefill_attention with its argument types declared; see the C source for layouts.

    Queries are float32 or bfloat16, and so is the output; the cache has their dtype, or a quantized format. A
    bfloat16 cache's products run on AMX's tiles where the build and the OS allow them (`amx`; set it False for
    the vector loops).
    """

    DTYPES = KERNEL_DTYPES

    @staticmethod
    def supports(head_dim: int) -> bool:
        # Products and sums run in 32-float pieces of the head; other head sizes take the torch path.
        return head_dim % 32 == 0

    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = library_isa(library)
        self._function = library.paged_prefill_attention
        self._function.restype = _INT
        self._function.argtypes = [_PTR, _I64, _PTR, _PTR, _INT, _INT, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                                   _I64, _I64, _I64, _I64, _F32, _I64, _PTR, _INT]
        self.amx = amx_bf16_ready(library)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunks: PrefillChunks,
        scale: float,
        sliding_window: int = 0,
        kv_format: KVCacheFormat | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [tokens, num_heads, head_dim] (rows may be strided); caches: [num_blocks, kv_heads, block_size,
        head_dim] (or runs of a quantized `kv_format`), already holding every chunk's keys and values. Returns
        [tokens, num_heads, head_dim]; rows no chunk covers are left unwritten.

        sliding_window > 0: the query at position p attends keys in (p - sliding_window, p] only.
        sinks: None, or [num_heads] float32 logits each head's softmax denominator also holds."""
        quantized = kv_format is not None and kv_format.quantized
        if q.dtype not in self.DTYPES or v_cache.dtype != k_cache.dtype or not quantized and k_cache.dtype != q.dtype:
            raise TypeError(f"the native prefill kernel takes float32 or bfloat16 queries and caches of one dtype "
                            f"(or a quantized cache), not q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
        tokens, num_heads, head_dim = q.shape
        if k_cache.dim() == 4 and k_cache.shape[3] != head_dim:
            raise ValueError(f"q has heads of {head_dim}, the cache of {k_cache.shape[3]}: head sizes must match")
        format_code, num_kv_heads, block_size = _cache_geometry(k_cache, head_dim, kv_format)
        if num_heads % num_kv_heads:
            raise ValueError(f"q has {num_heads} heads, the cache {num_kv_heads}: the kv heads must divide the "
                             f"query heads")
        if not self.supports(head_dim):
            raise ValueError(f"head_dim={head_dim} is not a multiple of 32, which the native prefill kernel needs")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # the kernel takes a token stride only; heads must be adjacent
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache views must be contiguous for the native kernel")
        if sliding_window < 0:
            raise ValueError(f"sliding_window={sliding_window} must be 0 (full attention) or a positive key count")
        if chunks.tokens > tokens:
            raise ValueError(f"the chunks reach token {chunks.tokens} of q's {tokens}")
        tables = chunks.block_tables
        if chunks.max_seq_len > tables.shape[1] * block_size:
            raise ValueError(f"a sequence of {chunks.max_seq_len} tokens needs more than the "
                             f"{tables.shape[1]} blocks of {block_size} its table row holds")
        sinks = _checked_sinks(sinks, num_heads)
        out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype)
        failed = self._function(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), int(q.dtype == torch.bfloat16),
            format_code, tables.ctypes.data, tables.shape[1], chunks.query_starts.ctypes.data, chunks.query_lens.ctypes.data,
            chunks.seq_lens.ctypes.data, len(chunks.query_lens), out.data_ptr(), num_heads, num_kv_heads, head_dim,
            block_size, scale, sliding_window, sinks.data_ptr() if sinks is not None else None, int(self.amx),
        )
        if failed:
            raise MemoryError("the native prefill-attention kernel could not allocate its buffers")
        return out


class CpuOps:
    """The fused elementwise kernels on contiguous CPU tensors of float32 or bfloat16 (see cpu_ops.c); every
    tensor of one call has the same dtype, and bfloat16 results are rounded where torch's would be."""

    DTYPES = KERNEL_DTYPES

    @classmethod
    def supports(cls, hidden_size: int, intermediate_size: int, dtype: torch.dtype = torch.float32) -> bool:
        """Whether a model of these sizes and dtype can run on the fused ops (any size: rows have tails)."""
        return dtype in cls.DTYPES and hidden_size > 0 and intermediate_size > 0

    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = library_isa(library)
        self.library = library  # for the kernels built on these ops (pagellm/ops/decode_stack.py)
        self._add_rms_norm = library.add_rms_norm
        self._add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT]
        self._gemma_rms_norm = library.gemma_rms_norm
        self._gemma_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT]
        self._silu_and_mul = library.silu_and_mul
        self._silu_and_mul.argtypes = [_PTR, _PTR, _I64, _I64, _INT]
        self._rotary = library.rotary_inplace
        self._rotary.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _INT]
        for function in (self._add_rms_norm, self._gemma_rms_norm, self._silu_and_mul, self._rotary):
            function.restype = None

    @classmethod
    def _dtype_flag(cls, x: torch.Tensor) -> int:
        if x.dtype not in cls.DTYPES:
            raise TypeError(f"the fused CPU ops take float32 or bfloat16 tensors, not {x.dtype}; "
                            f"check CpuOps.supports(..., dtype) before enabling them")
        return int(x.dtype == torch.bfloat16)

    # These run a few times per layer per decode step: the usual float32, contiguous call costs one identity
    # test per check, and only a call that fails one pays for the full check and its message.

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """RMSNorm of x, or of x + residual after adding x into residual in place (then returns both)."""
        return self._rms_norm(self._add_rms_norm, x, residual, weight, eps, x.dtype)

    def gemma_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, offset_weight: torch.Tensor,
                       eps: float):
        """add_rms_norm with Gemma's numerics: `offset_weight` (1 + weight) is float32 whatever x's dtype, and
        the normalised row times it is rounded once (cpu_ops.c's gemma_rms_norm)."""
        return self._rms_norm(self._gemma_rms_norm, x, residual, offset_weight, eps, torch.float32)

    def _rms_norm(self, function, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  weight_dtype: torch.dtype):
        dtype = x.dtype
        bf16 = 0 if dtype is torch.float32 else self._dtype_flag(x)
        if not x.is_contiguous():
            x = x.contiguous()
        if weight.dtype is not weight_dtype:
            _check_dtype("weight", weight, weight_dtype)
        if not weight.is_contiguous():
            weight = weight.contiguous()
        out = torch.empty_like(x)
        rows, hidden = x.shape
        if residual is not None:
            if residual.dtype is not dtype:
                _check_dtype("residual", residual, dtype)
            if not residual.is_contiguous():
                raise ValueError("the residual stream must be contiguous")
        function(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                 out.data_ptr(), rows, hidden, eps, bf16)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        dtype = gate_up.dtype
        bf16 = 0 if dtype is torch.float32 else self._dtype_flag(gate_up)
        if not gate_up.is_contiguous():
            gate_up = gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, width), dtype=dtype)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, width, bf16)
        return out

    def rotary_inplace(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate the first num_heads heads of each row of qkv [tokens, width] (contiguous) in place;
        cos/sin are the float32 [max_positions, head_dim] tables, positions int64."""
        bf16 = 0 if qkv.dtype is torch.float32 else self._dtype_flag(qkv)
        if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rotary_inplace needs contiguous qkv and cos/sin tables")
        if cos.dtype is not torch.float32 or sin.dtype is not torch.float32:
            _check_dtype("cos", cos, torch.float32)
            _check_dtype("sin", sin, torch.float32)
        if not positions.is_contiguous():
            positions = positions.contiguous()
        if positions.dtype is not torch.int64:
            _check_dtype("positions", positions, torch.int64)
        self._rotary(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], num_heads, head_dim, cos.data_ptr(),
                     sin.data_ptr(), positions.data_ptr(), bf16)


class KVWriter:
    """write_kv_rows: the step's keys and values into their cache rows (the torch path's index_copy_); for a
    quantized format, write_kv_rows_quantized (kv_spec.py's KVCacheFormat.quantize, byte for byte)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.write_kv_rows
        self._function.restype = None
        self._function.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
        self._quantized = library.write_kv_rows_quantized
        self._quantized.restype = None
        self._quantized.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT, _INT]

    @staticmethod
    def writes(kv_format: KVCacheFormat, dtype: torch.dtype) -> bool:
        """Whether K/V of `dtype` go into a cache of `kv_format` here (quantizing takes float32 or bfloat16)."""
        return not kv_format.quantized or dtype in KERNEL_DTYPES

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rows: torch.Tensor, kv_format: KVCacheFormat | None = None) -> None:
        """k, v: [tokens, kv_heads, head_dim] (rows may be strided, heads contiguous); caches contiguous
        [num_blocks, kv_heads, block_size, head_dim] (or runs of a quantized `kv_format`); rows: int64
        [tokens * kv_heads] (kv_write_index)."""
        tokens, num_kv_heads, head_dim = k.shape
        quantized = kv_format is not None and kv_format.quantized
        if quantized and v.dtype != k.dtype:
            raise ValueError(f"k is {k.dtype} and v {v.dtype}; quantizing takes them in one dtype")
        for name, x in (("k", k), ("v", v)):
            if (x.dtype not in KERNEL_DTYPES if quantized else x.dtype != k_cache.dtype) or x.shape != k.shape:
                wanted = "float32 or bfloat16" if quantized else k_cache.dtype
                raise ValueError(f"{name} is {x.dtype} {tuple(x.shape)}; the cache takes {wanted} {tuple(k.shape)}")
        k, v = (x if x.stride(2) == 1 and x.stride(1) == head_dim else x.contiguous() for x in (k, v))
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype):
            raise ValueError("write_kv_rows needs contiguous caches of one dtype")
        _check_dtype("rows", rows, torch.int64)
        if rows.numel() != tokens * num_kv_heads or not rows.is_contiguous():
            raise ValueError(f"rows has {rows.numel()} entries; {tokens} tokens x {num_kv_heads} heads need "
                             f"as many, contiguous")
        if quantized:
            format_code, _, block_size = _cache_geometry(k_cache, head_dim, kv_format)
            self._quantized(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                            v_cache.data_ptr(), rows.data_ptr(), tokens, num_kv_heads, head_dim, block_size,
                            int(k.dtype == torch.bfloat16), format_code)
            return
        self._function(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                       v_cache.data_ptr(), rows.data_ptr(), tokens, num_kv_heads, head_dim, k.element_size())


class LinearBF16:
    """linear_bf16 (see linear_bf16.c): bfloat16 linear layers on a weight packed for it, where the library was
    built with avx512_bf16's dot product; `available(library)` says whether it was. Where it was also built with
    AMX's tiles and the OS grants them, calls of `amx_min_rows` rows or more run on the tiles (`amx` says so)."""

    PANEL = 16
    # From this many rows the tiles beat the vector path, over 30 layers of SmolLM2's shapes streamed from memory
    # (README, "On a CPU with AMX").
    AMX_MIN_ROWS = 8

    @staticmethod
    def available(library: ctypes.CDLL) -> bool:
        return bool(ctypes.c_int.in_dll(library, "pagellm_linear_bf16_available").value)

    @classmethod
    def supports(cls, in_features: int, out_features: int) -> bool:
        return in_features % 2 == 0 and out_features % cls.PANEL == 0 and in_features > 0 and out_features > 0

    def __init__(self, library: ctypes.CDLL) -> None:
        if not self.available(library):
            raise ValueError(f"the {library_isa(library)} kernels were built without avx512_bf16's dot product")
        self.isa = library_isa(library)
        self.library = library  # for the decode stack's product pointer (pagellm/ops/decode_stack.py)
        self._function = library.linear_bf16
        self._function.restype = _INT
        self._function.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
        self.amx = amx_bf16_ready(library)
        self.amx_min_rows = self.AMX_MIN_ROWS if self.amx else NEVER_ROWS

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] bfloat16 -> [out / 16, in / 2, 16, 2]: one 64-byte vector per 16 outputs and input pair."""
        out_features, in_features = weight.shape
        if weight.dtype != torch.bfloat16 or not cls.supports(in_features, out_features):
            raise ValueError(f"linear_bf16 packs bfloat16 weights with an even in_features and out_features a "
                             f"multiple of {cls.PANEL}, not {weight.dtype} {tuple(weight.shape)}")
        return weight.view(out_features // cls.PANEL, cls.PANEL, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] bfloat16 -> [..., out] bfloat16."""
        panels, pairs, _, _ = packed.shape
        in_features, out_features = 2 * pairs, panels * self.PANEL
        if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
            raise ValueError(f"x is {x.dtype} {tuple(x.shape)}; this layer takes bfloat16 [..., {in_features}]")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)):
            raise ValueError(f"bias is {bias.dtype} {tuple(bias.shape)}; this layer takes bfloat16 [{out_features}]")
        # A decode step makes ~120 of these calls: the usual 2-D contiguous input takes no reshape or copy.
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
        y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        if self._function(rows.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                          y.data_ptr(), rows.shape[0], in_features, out_features, self.amx_min_rows):
            raise ValueError(f"linear_bf16 refused in_features={in_features}, out_features={out_features}")
        return y if rows is x else y.view(*x.shape[:-1], out_features)


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


def _on_library(kind, isa: str | None):
    """`kind` (a kernel wrapper class) bound to the library for `isa`, or None where there is none."""
    library = native_library(isa)
    return kind(library) if library is not None else None


def decode_kernel(isa: str | None = None) -> DecodeKernel | None:
    return _on_library(DecodeKernel, isa)


def kv_writer(isa: str | None = None) -> KVWriter | None:
    return _on_library(KVWriter, isa)


def prefill_kernel(isa: str | None = None) -> PrefillKernel | None:
    return _on_library(PrefillKernel, isa)


def cpu_ops(isa: str | None = None) -> CpuOps | None:
    return _on_library(CpuOps, isa)


def linear_bf16(isa: str | None = None) -> LinearBF16 | None:
    """The bfloat16 linear kernel, or None where the library for `isa` has none (no avx512_bf16, no compiler)."""
    library = native_library(isa)
    return LinearBF16(library) if library is not None and LinearBF16.available(library) else None


def find_compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    return compiler


def _build(isa: str) -> pathlib.Path:
    return build_library(f"pagellm_cpu_{isa}", _SOURCES, _HEADERS, compiler_flags(isa))


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
