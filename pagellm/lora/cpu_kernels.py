"""The C kernel of LoRA's grouped shrink/expand on the CPU (csrc/lora.c), built per instruction set as pagellm's
other kernels are, and called once per layer per step. float32 only; elsewhere (bfloat16 activations, no compiler,
PAGELLM_NATIVE_KERNELS=0) the torch path in punica.py runs, which is also what the kernel is tested against."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import subprocess

import numpy as np
import torch

from pagellm.ops import cpu_build

logger = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).resolve().parent.parent / "ops" / "csrc" / "lora.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# csrc/lora.c's MAX_WIDTH: the widest slot (shards x max_lora_rank) it takes; wider ones run on torch.
MAX_WIDTH = 768


class LoRAKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.fn = library.pagellm_lora_sgmv_f32
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64]

    @staticmethod
    def supports(x: torch.Tensor, out: torch.Tensor, width: int) -> bool:
        return (width <= MAX_WIDTH and x.dtype == out.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1
                and out.stride(-1) == 1 and x.dim() == out.dim() == 2)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, rows: np.ndarray,
                 segments: np.ndarray, widths: np.ndarray) -> torch.Tensor:
        """out[rows[g]] += (x[rows[g]] @ a[s, :w]^T) @ b_t[s, :w] for each segment (s, start, end) of rows g."""
        cap = a.shape[1]
        status = self.fn(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), a.data_ptr(), b_t.data_ptr(),
                         cap, a.shape[2], b_t.shape[2], rows.ctypes.data, segments.ctypes.data, len(segments),
                         widths.ctypes.data, a.shape[0])
        if status != 0:
            raise ValueError("the LoRA kernel refused a segment's slot or width")
        return out


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    try:
        path = cpu_build.build_library(f"pagellm_lora_{isa}", [_SOURCE], [], cpu_build.compiler_flags(isa))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip()
        logger.warning("LoRA CPU kernel unavailable (%s); adapters run on torch",
                       detail.splitlines()[0] if detail else type(error).__name__)
        return None


def lora_kernel(isa: str | None = None) -> LoRAKernel | None:
    """The kernel built for `isa` (default: cpu_build.best_isa()), or None where there is no compiler or
    PAGELLM_NATIVE_KERNELS=0."""
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        return None
    library = _library(isa or cpu_build.best_isa())
    return LoRAKernel(library) if library is not None else None
