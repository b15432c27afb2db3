"""The experts of a mixture-of-experts layer in one native call per step on the CPU (moe_experts.c): the step's
(token, expert) pairs sorted by expert, each expert's gate/up and down read once for all its rows, SiLU-and-multiply,
the router weights and the sum back into each token's row, in float32 or bfloat16."""

from __future__ import annotations

import ctypes

import torch

from pagellm.attention.native import native_library

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_DTYPES = (torch.float32, torch.bfloat16)
_ERRORS = {1: "an expert id is outside [0, experts)", 2: "sizes the kernel does not take",
           3: "out of memory for the step's rows"}


class CpuMoEKernel:
    """Runs stacked experts (w13 [E, 2I, H] gate then up rows, w2 [E, H, I]) over a step's routed tokens."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.moe_experts
        self._function.restype = _INT
        self._function.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT]

    @staticmethod
    def supports(w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """Contiguous float32 or bfloat16 stacks on the CPU with an even intermediate size and a hidden size
        divisible by 4 (the kernel's tiles)."""
        experts, double_inter, hidden = w13.shape
        return (w13.device.type == "cpu" and w13.dtype in _DTYPES and w2.dtype == w13.dtype
                and w13.is_contiguous() and w2.is_contiguous() and double_inter % 4 == 0 and hidden % 4 == 0
                and tuple(w2.shape) == (experts, hidden, double_inter // 2))

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: each token's experts' outputs weighted by its router weights and summed."""
        experts, double_inter, hidden = w13.shape
        tokens, top_k = topk_ids.shape
        if x.dtype != w13.dtype or x.shape != (tokens, hidden):
            raise ValueError(f"x is {x.dtype} {tuple(x.shape)}; these experts take {w13.dtype} [{tokens}, {hidden}]")
        if tokens == 0:
            return torch.empty_like(x)
        x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        status = self._function(x.data_ptr(), w13.data_ptr(), w2.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                                out.data_ptr(), tokens, top_k, experts, hidden, double_inter // 2,
                                int(x.dtype == torch.bfloat16))
        if status:
            raise ValueError(f"moe_experts refused {tokens} tokens x top_k={top_k} over {experts} experts "
                             f"(hidden {hidden}, intermediate {double_inter // 2}): {_ERRORS.get(status, status)}")
        return out


def cpu_moe_kernel() -> CpuMoEKernel | None:
    """The native kernel, or None where the library cannot be built or native kernels are switched off."""
    library = native_library()
    return CpuMoEKernel(library) if library is not None else None
