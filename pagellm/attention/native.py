"""pagellm's attention kernels for the CPU, called via ctypes on the library ops/cpu_build.py builds.

csrc/paged_attention.c is decode attention straight from the paged cache (float32 or bfloat16 queries;
float32, bfloat16 or quantized caches; float32 arithmetic, optional sliding window); csrc/prefill_attention.c
the causal attention of a step's prefill chunks from the same cache, flash-style; csrc/kv_write.c the K/V
writers; csrc/kv_format.h the cache's element formats (kv_spec.py's KVCacheFormat: reading codes in registers,
quantizing rows as they are written). Where the library cannot be built or PAGELLM_NATIVE_KERNELS=0 is set,
`decode_kernel()`, `prefill_kernel()` and `kv_writer()` return None and attention runs on torch ops.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.kv_spec import KVCacheFormat
from pagellm.ops.cpu_build import KERNEL_DTYPES, amx_bf16_ready, library_isa, native_library
from pagellm.ops.cpu_ops import check_dtype

_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int

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


def _checked_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Attention sinks as the kernels read them: contiguous float32 [num_heads] (None: no sinks)."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or sinks.device.type != "cpu":
        raise ValueError(f"sinks is {sinks.device} {tuple(sinks.shape)}; the kernels take one float32 logit per "
                         f"query head, [{num_heads}] on the CPU")
    return sinks.to(torch.float32).contiguous()


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
        if (q.dtype not in self.DTYPES or v_cache.dtype != k_cache.dtype
                or not quantized and k_cache.dtype != q.dtype and k_cache.dtype != torch.bfloat16):
            raise TypeError(f"the native prefill kernel takes float32 or bfloat16 queries and caches of their dtype "
                            f"(or bfloat16, or quantized), not q {q.dtype}, k_cache {k_cache.dtype}, v_cache "
                            f"{v_cache.dtype}")
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
        self._to_bf16 = library.write_kv_rows_to_bf16
        self._to_bf16.restype = None
        self._to_bf16.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]

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
        # A cache of its own dtype (kv_cache_dtype="bfloat16" under a float32 model): rounded as torch rounds,
        # by the C writer where it converts the pair of dtypes, else by torch before the copy.
        narrowing = not quantized and k_cache.dtype == torch.bfloat16 and k.dtype == v.dtype == torch.float32
        if not (quantized or narrowing) and k_cache.dtype != k.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        for name, x in (("k", k), ("v", v)):
            fits = x.dtype in KERNEL_DTYPES if quantized else narrowing or x.dtype == k_cache.dtype
            if not fits or x.shape != k.shape:
                wanted = "float32 or bfloat16" if quantized else k_cache.dtype
                raise ValueError(f"{name} is {x.dtype} {tuple(x.shape)}; the cache takes {wanted} {tuple(k.shape)}")
        k, v = (x if x.stride(2) == 1 and x.stride(1) == head_dim else x.contiguous() for x in (k, v))
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype):
            raise ValueError("write_kv_rows needs contiguous caches of one dtype")
        check_dtype("rows", rows, torch.int64)
        if rows.numel() != tokens * num_kv_heads or not rows.is_contiguous():
            raise ValueError(f"rows has {rows.numel()} entries; {tokens} tokens x {num_kv_heads} heads need "
                             f"as many, contiguous")
        if quantized:
            format_code, _, block_size = _cache_geometry(k_cache, head_dim, kv_format)
            self._quantized(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                            v_cache.data_ptr(), rows.data_ptr(), tokens, num_kv_heads, head_dim, block_size,
                            int(k.dtype == torch.bfloat16), format_code)
            return
        if narrowing:
            self._to_bf16(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                          v_cache.data_ptr(), rows.data_ptr(), tokens, num_kv_heads, head_dim)
            return
        self._function(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                       v_cache.data_ptr(), rows.data_ptr(), tokens, num_kv_heads, head_dim, k.element_size())


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
