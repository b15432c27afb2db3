"""The C decode-attention kernel (csrc/paged_attention.c): compiled on first use, cached, called via ctypes.

Compiling needs only a C compiler (cc/gcc) and takes about a second; the shared object is cached under
pagellm's cache directory, keyed by the source, the compiler and this CPU, so later starts just load it.
Where there is no compiler, or PAGELLM_NATIVE_ATTENTION=0 is set, `decode_kernel()` returns None and
attention runs on the torch path, which stays the reference the kernel is tested against.

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

logger = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "paged_attention.c"
# No -ffast-math: the kernel is vectorised by hand, and its summation order and exp must stay as written.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class DecodeKernel:
    """paged_decode_attention_f32 with its argument types declared; see the C source for layouts."""

    @staticmethod
    def supports(head_dim: int) -> bool:
        # The kernel works in 8-float vectors.
        return head_dim % 8 == 0

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.paged_decode_attention_f32
        self._function.restype = ctypes.c_int
        self._function.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32]

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        scale: float,
    ) -> torch.Tensor:
        """q: [num_seqs, num_heads, head_dim] float32; caches: [num_blocks, block_size, kv_heads, head_dim]."""
        q = q.contiguous()
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache views must be contiguous for the native kernel")
        if block_tables.dtype != np.int64 or context_lens.dtype != np.int64:
            raise TypeError("block_tables and context_lens must be int64 arrays")
        block_tables = np.ascontiguousarray(block_tables)
        context_lens = np.ascontiguousarray(context_lens)
        out = torch.empty_like(q)
        failed = self._function(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.ctypes.data,
            block_tables.shape[1], context_lens.ctypes.data, out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
        )
        if failed == 1:
            raise MemoryError("the native decode-attention kernel could not allocate its score buffer")
        if failed:
            raise ValueError(f"head_dim={head_dim} is not a multiple of 8, which the native kernel needs")
        return out


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """The compiled kernel, or None where it cannot be built or is switched off (torch path then)."""
    if os.environ.get("PAGELLM_NATIVE_ATTENTION", "1") == "0":
        return None
    try:
        return DecodeKernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        logger.warning("native decode attention unavailable (%s); using the torch path", _first_line(error))
        return None


def _build() -> pathlib.Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(), _cpu_identity()]))
    target = cache_root() / "kernels" / f"paged_attention-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile next to the target and rename: concurrent engines never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = pathlib.Path(tmp) / target.name
        result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, compiler, stderr=result.stderr)
        os.replace(built, target)
    logger.info("compiled the native decode-attention kernel: %s", target)
    return target


def _cpu_identity() -> bytes:
    """-march=native code is only valid on CPUs with the same features: the cache key includes them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line.encode()
    except OSError:
        pass
    return platform.processor().encode() + platform.machine().encode()


def _first_line(error: Exception) -> str:
    detail = getattr(error, "stderr", None) or str(error)
    return detail.strip().splitlines()[0] if detail.strip() else type(error).__name__
