"""The experts of a mixture-of-experts layer in one native call per step on the CPU (moe_experts.c): the step's
(token, expert) pairs sorted by expert, each expert's gate/up and down read once for all its rows, SiLU-and-multiply,
the router weights and the sum back into each token's row, in float32 or bfloat16, on weights packed at load."""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from pagellm.attention.native import native_library
from pagellm.worker.huge_pages import advise_huge_pages

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_DTYPES = (torch.float32, torch.bfloat16)
_ERRORS = {1: "an expert id is outside [0, experts)", 2: "sizes the kernel does not take",
           3: "out of memory for the step's rows"}


# Features (gate/up) or outputs (down) per packed panel: moe_experts.c's PANEL.
PANEL = 16


def _panels(width: int) -> int:
    return -(-width // PANEL)


class CpuMoEKernel:
    """Runs stacked experts over a step's routed tokens, on weights packed once by `pack` (moe_experts.c's
    panels: for each input element, PANEL consecutive features' weights side by side)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.moe_experts
        self._function.restype = _INT
        self._function.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _PTR]
        # Per calling thread: the kernel's row buffers, kept and grown (fresh ones would be faulted in every step).
        self._scratch = threading.local()
        self._pack = library.moe_pack_experts
        self._pack.restype = None
        self._pack.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]

    @staticmethod
    def supports(w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """Stacked float32 or bfloat16 experts on the CPU (w13 [E, 2I, H] gate then up rows, w2 [E, H, I])."""
        experts, double_inter, hidden = w13.shape
        return (w13.device.type == "cpu" and w13.dtype in _DTYPES and w2.dtype == w13.dtype
                and double_inter % 2 == 0 and double_inter > 0 and hidden > 0
                and tuple(w2.shape) == (experts, hidden, double_inter // 2))

    def pack(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's layouts of the stacked experts: w13 [E, panels(I), 2, H, PANEL], w2 [E, panels(H), I,
        PANEL], features past I or H zero."""
        if not self.supports(w13, w2):
            raise ValueError(f"moe_experts packs float32/bfloat16 stacks w13 [E, 2I, H], w2 [E, H, I]; got "
                             f"{w13.dtype} {tuple(w13.shape)} and {w2.dtype} {tuple(w2.shape)}")
        experts, double_inter, hidden = w13.shape
        inter = double_inter // 2
        w13, w2 = w13.contiguous(), w2.contiguous()
        w13p = torch.empty(experts, _panels(inter), 2, hidden, PANEL, dtype=w13.dtype)
        w2p = torch.empty(experts, _panels(hidden), inter, PANEL, dtype=w2.dtype)
        # New memory, which the loader's advice on the parameters did not cover: huge pages before the first write
        # (a decode step streams the used experts' panels at the memory's bandwidth).
        advise_huge_pages([w13p, w2p])
        self._pack(w13.data_ptr(), w2.data_ptr(), w13p.data_ptr(), w2p.data_ptr(), experts, hidden, inter,
                   int(w13.dtype == torch.bfloat16))
        return w13p, w2p

    def __call__(self, x: torch.Tensor, w13p: torch.Tensor, w2p: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: each token's experts' outputs weighted by its router weights and summed; w13p and
        w2p as `pack` made them."""
        experts, _, _, hidden, _ = w13p.shape
        inter = w2p.shape[2]
        tokens, top_k = topk_ids.shape
        if (w13p.shape[1:] != (_panels(inter), 2, hidden, PANEL) or w2p.shape != (experts, _panels(hidden), inter, PANEL)
                or w2p.dtype != w13p.dtype or not w13p.is_contiguous() or not w2p.is_contiguous()):
            raise ValueError(f"packed experts {tuple(w13p.shape)} and {tuple(w2p.shape)} are not CpuMoEKernel.pack's")
        if x.dtype != w13p.dtype or x.shape != (tokens, hidden):
            raise ValueError(f"x is {x.dtype} {tuple(x.shape)}; these experts take {w13p.dtype} [{tokens}, {hidden}]")
        if tokens == 0:
            return torch.empty_like(x)
        x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        pairs = tokens * top_k
        activated = self._buffer("activated", pairs * _panels(inter) * PANEL, x.dtype)
        rows_out = self._buffer("rows_out", pairs * _panels(hidden) * PANEL, torch.float32)
        status = self._function(x.data_ptr(), w13p.data_ptr(), w2p.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                                out.data_ptr(), tokens, top_k, experts, hidden, inter,
                                int(x.dtype == torch.bfloat16), activated.data_ptr(), rows_out.data_ptr())
        if status:
            raise ValueError(f"moe_experts refused {tokens} tokens x top_k={top_k} over {experts} experts "
                             f"(hidden {hidden}, intermediate {inter}): {_ERRORS.get(status, status)}")
        return out


    def _buffer(self, name: str, elements: int, dtype: torch.dtype) -> torch.Tensor:
        buffers = self._scratch.__dict__.setdefault("buffers", {})
        buffer = buffers.get((name, dtype))
        if buffer is None or buffer.numel() < elements:
            buffer = buffers[(name, dtype)] = torch.empty(elements, dtype=dtype)
        return buffer


def cpu_moe_kernel() -> CpuMoEKernel | None:
    """The native kernel, or None where the library cannot be built or native kernels are switched off. One per
    library, which every MoE layer shares: its row buffers are one step's, not one per layer."""
    library = native_library()
    return _kernel_of(library) if library is not None else None


@functools.cache
def _kernel_of(library: ctypes.CDLL) -> CpuMoEKernel:
    return CpuMoEKernel(library)
