"""The fused elementwise layers on the CPU (csrc/cpu_ops.c): RMSNorm with the residual add (and Gemma's),
SiLU-and-multiply and in-place rotary embedding, float32 or bfloat16, from the library cpu_build.py builds."""

from __future__ import annotations

import ctypes

import torch

from pagellm.ops.cpu_build import KERNEL_DTYPES, library_isa, native_library

_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int


def check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} here, not {tensor.dtype} (the activations, residual and norm "
                        f"weight share one dtype; rotary tables are float32, positions int64)")


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
            check_dtype("weight", weight, weight_dtype)
        if not weight.is_contiguous():
            weight = weight.contiguous()
        out = torch.empty_like(x)
        rows, hidden = x.shape
        if residual is not None:
            if residual.dtype is not dtype:
                check_dtype("residual", residual, dtype)
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
            check_dtype("cos", cos, torch.float32)
            check_dtype("sin", sin, torch.float32)
        if not positions.is_contiguous():
            positions = positions.contiguous()
        if positions.dtype is not torch.int64:
            check_dtype("positions", positions, torch.int64)
        self._rotary(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], num_heads, head_dim, cos.data_ptr(),
                     sin.data_ptr(), positions.data_ptr(), bf16)


def cpu_ops(isa: str | None = None) -> CpuOps | None:
    """The fused ops of the library for `isa`, or None where there is none (torch ops then)."""
    library = native_library(isa)
    return CpuOps(library) if library is not None else None
