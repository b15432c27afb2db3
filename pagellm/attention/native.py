"""pagellm's C kernels for the CPU: compiled on first use, cached, called via ctypes.

csrc/paged_attention.c is decode attention straight from the paged cache (float32 or bfloat16 caches,
float32 arithmetic); csrc/cpu_ops.c holds the float32 fused RMSNorm (with the residual add),
SiLU-and-multiply and in-place rotary embedding; csrc/vec8.h the vector helpers both use.

Compiling needs only a C compiler (cc/gcc) and takes about a second; the shared object is cached under
pagellm's cache directory, keyed by the source, the compiler and this CPU, so later starts just load it.
Where there is no compiler, or PAGELLM_NATIVE_KERNELS=0 is set, `decode_kernel()` and `cpu_ops()`
return None and the model runs on torch ops, which stay the reference the kernels are tested against.

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

import numpy as np
import torch

from pagellm.cache_dir import cache_root
from pagellm.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

_SOURCES = [pathlib.Path(__file__).with_name("csrc") / name for name in ("paged_attention.c", "cpu_ops.c")]
_HEADERS = [pathlib.Path(__file__).with_name("csrc") / "vec8.h"]
# No -ffast-math: the kernel is vectorised by hand, and its summation order and exp must stay as written.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class DecodeKernel:
    """paged_decode_attention with its argument types declared; see the C source for layouts.

    Caches may be float32 or bfloat16; queries and outputs cross the boundary in float32.
    """

    CACHE_DTYPES = (torch.float32, torch.bfloat16)

    @staticmethod
    def supports(head_dim: int) -> bool:
        # The kernel sums values in 32-float pieces (four 8-float vectors); other head sizes take the torch path.
        return head_dim % 32 == 0

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.paged_decode_attention
        self._function.restype = ctypes.c_int
        self._function.argtypes = [_PTR, _PTR, _PTR, ctypes.c_int, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                   _I64, _F32, _I64]

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        scale: float,
        sliding_window: int = 0,
    ) -> torch.Tensor:
        """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, kv_heads, block_size, head_dim].

        sliding_window > 0 reads only the last sliding_window keys of each sequence (0: all of them)."""
        if k_cache.dtype not in self.CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
            raise TypeError(f"the native kernel reads float32 or bfloat16 caches, not {k_cache.dtype}")
        query_dtype = q.dtype
        q = q.to(torch.float32).contiguous()
        num_seqs, num_heads, head_dim = q.shape
        _, num_kv_heads, block_size, _ = k_cache.shape
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache views must be contiguous for the native kernel")
        if block_tables.dtype != np.int64 or context_lens.dtype != np.int64:
            raise TypeError("block_tables and context_lens must be int64 arrays")
        block_tables = np.ascontiguousarray(block_tables)
        context_lens = np.ascontiguousarray(context_lens)
        out = torch.empty_like(q)
        failed = self._function(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
            block_tables.ctypes.data,
            block_tables.shape[1], context_lens.ctypes.data, out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
        )
        if failed == 1:
            raise MemoryError("the native decode-attention kernel could not allocate its score buffer")
        if failed:
            raise ValueError(f"head_dim={head_dim} is not a multiple of 32, which the native kernel needs")
        return out.to(query_dtype)


class CpuOps:
    """The fused elementwise kernels; each takes and returns float32 CPU tensors (see cpu_ops.c)."""

    @staticmethod
    def supports(hidden_size: int, intermediate_size: int) -> bool:
        return hidden_size % 8 == 0 and intermediate_size % 8 == 0

    def __init__(self, library: ctypes.CDLL) -> None:
        self._add_rms_norm = library.add_rms_norm_f32
        self._add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32]
        self._silu_and_mul = library.silu_and_mul_f32
        self._silu_and_mul.argtypes = [_PTR, _PTR, _I64, _I64]
        self._rotary = library.rotary_inplace_f32
        self._rotary.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]
        for function in (self._add_rms_norm, self._silu_and_mul, self._rotary):
            function.restype = None

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """RMSNorm of x, or of x + residual after adding x into residual in place (then returns both)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, hidden = x.shape
        if residual is not None and not residual.is_contiguous():
            raise ValueError("the residual stream must be contiguous")
        self._add_rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                           out.data_ptr(), rows, hidden, eps)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, width), dtype=gate_up.dtype)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out

    def rotary_inplace(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate the first num_heads heads of each row of qkv [tokens, width] (contiguous) in place."""
        if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("rotary_inplace needs contiguous qkv and cos/sin tables")
        positions = positions.contiguous()
        self._rotary(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], num_heads, head_dim, cos.data_ptr(),
                     sin.data_ptr(), positions.data_ptr())


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or are switched off (torch ops then)."""
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        logger.warning("native CPU kernels unavailable (%s); using torch ops", _first_line(error))
        return None


def decode_kernel() -> DecodeKernel | None:
    library = native_library()
    return DecodeKernel(library) if library is not None else None


def cpu_ops() -> CpuOps | None:
    library = native_library()
    return CpuOps(library) if library is not None else None


def _build() -> pathlib.Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    sources = [source.read_bytes() for source in _SOURCES + _HEADERS]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([*sources, " ".join(_FLAGS).encode(), version.encode(), _cpu_identity()]))
    target = cache_root() / "kernels" / f"pagellm_cpu-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile next to the target and rename: concurrent engines never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = pathlib.Path(tmp) / target.name
        result = subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, compiler, stderr=result.stderr)
        os.replace(built, target)
    logger.info("compiled the native CPU kernels: %s", target)
    return target


def _cpu_identity() -> bytes:
    """-march=native code is only valid on CPUs with the same features: the cache key includes them."""
    flags = " ".join(sorted(cpu_flags())) or platform.processor() + platform.machine()
    return flags.encode()


def _first_line(error: Exception) -> str:
    detail = getattr(error, "stderr", None) or str(error)
    return detail.strip().splitlines()[0] if detail.strip() else type(error).__name__
