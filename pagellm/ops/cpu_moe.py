"""The experts of a mixture-of-experts layer in one native call per step on the CPU (moe_experts.c): the step's
(token, expert) pairs sorted by expert, each expert's gate/up and down read once for all its rows, SiLU-and-multiply,
the router weights and the sum back into each token's row, in float32 or bfloat16, on weights packed at load.

Two packings: moe_experts.c's panels (float32, and bfloat16 widened per product), and, where the library has
avx512_bf16's dot product, bfloat16 experts in linear_bf16's layout (`LinearBF16.pack` per expert, stacked), which
the kernel multiplies with VDPBF16PS and which linear_bf16 itself can take one expert at a time (AMX prefill)."""

from __future__ import annotations

import ctypes
import functools

import torch

from pagellm.ops.cpu_build import native_library
from pagellm.ops.linear_bf16 import LinearBF16
from pagellm.ops.scratch import thread_scratch
from pagellm.worker.huge_pages import advise_huge_pages

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_DTYPES = (torch.float32, torch.bfloat16)
_ERRORS = {1: "an expert id is outside [0, experts)", 2: "sizes the kernel does not take",
           3: "out of memory for the step's rows"}


# Features (gate/up) or outputs (down) per packed panel: moe_experts.c's PANEL.
PANEL = 16


def _panels(width: int) -> int:
    return -(-width // PANEL)


# moe_experts' layout argument.
_FLOAT32_PANELS, _BF16_PANELS, _BF16_DOT = 0, 1, 2


class CpuMoEKernel:
    """Runs stacked experts over a step's routed tokens, on weights packed once by `pack` (moe_experts.c's
    panels: for each input element, PANEL consecutive features' weights side by side; or linear_bf16's layout
    per expert, `dot_layout`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        # Whether bfloat16 experts take VDPBF16PS on linear_bf16's layout (builds with avx512_bf16).
        self.bf16_dot = bool(ctypes.c_int.in_dll(library, "pagellm_moe_bf16_dot_available").value)
        self._function = library.moe_experts
        self._function.restype = _INT
        self._function.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _PTR]
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

    def takes_dot_layout(self, w13: torch.Tensor, w2: torch.Tensor) -> bool:
        """Whether `pack` gives these experts linear_bf16's layout: bfloat16, hidden and intermediate sizes
        multiples of 16, a library with the bf16 dot product."""
        experts, double_inter, hidden = w13.shape
        return (self.bf16_dot and self.supports(w13, w2) and w13.dtype == torch.bfloat16
                and hidden % PANEL == 0 and (double_inter // 2) % PANEL == 0)

    def pack(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's layouts of the stacked experts: linear_bf16's per expert (w13 [E, 2I / 16, H / 2, 16, 2],
        w2 [E, H / 16, I / 2, 16, 2]) where `takes_dot_layout`, else moe_experts.c's panels (w13 [E, panels(I), 2,
        H, PANEL], w2 [E, panels(H), I, PANEL], features past I or H zero)."""
        if not self.supports(w13, w2):
            raise ValueError(f"moe_experts packs float32/bfloat16 stacks w13 [E, 2I, H], w2 [E, H, I]; got "
                             f"{w13.dtype} {tuple(w13.shape)} and {w2.dtype} {tuple(w2.shape)}")
        experts, double_inter, hidden = w13.shape
        inter = double_inter // 2
        if self.takes_dot_layout(w13, w2):
            return _dot_pack(w13), _dot_pack(w2)
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
        layout, experts, hidden, inter = self._layout(w13p, w2p)
        tokens, top_k = topk_ids.shape
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
                                out.data_ptr(), tokens, top_k, experts, hidden, inter, layout,
                                activated.data_ptr(), rows_out.data_ptr())
        if status:
            raise ValueError(f"moe_experts refused {tokens} tokens x top_k={top_k} over {experts} experts "
                             f"(hidden {hidden}, intermediate {inter}): {_ERRORS.get(status, status)}")
        return out

    def _layout(self, w13p: torch.Tensor, w2p: torch.Tensor) -> tuple[int, int, int, int]:
        """(layout, experts, hidden, inter) of packed experts, or a ValueError if they are not `pack`'s."""
        if w2p.dim() == 5 and w13p.dim() == 5 and w13p.shape[-2:] == (PANEL, 2):  # linear_bf16's layout
            experts, double_panels, hidden_pairs, _, _ = w13p.shape
            hidden, inter = 2 * hidden_pairs, double_panels * PANEL // 2
            fits = (self.bf16_dot and w13p.dtype == torch.bfloat16 and double_panels % 2 == 0
                    and w2p.shape == (experts, hidden // PANEL, inter // 2, PANEL, 2) and hidden % PANEL == 0)
            layout = _BF16_DOT
        elif w13p.dim() == 5 and w2p.dim() == 4:
            experts, _, _, hidden, _ = w13p.shape
            inter = w2p.shape[2]
            fits = (w13p.shape[1:] == (_panels(inter), 2, hidden, PANEL)
                    and w2p.shape == (experts, _panels(hidden), inter, PANEL))
            layout = _BF16_PANELS if w13p.dtype == torch.bfloat16 else _FLOAT32_PANELS
        else:
            fits = False
        if not fits or w2p.dtype != w13p.dtype or not w13p.is_contiguous() or not w2p.is_contiguous():
            raise ValueError(f"packed experts {tuple(w13p.shape)} and {tuple(w2p.shape)} are not CpuMoEKernel.pack's")
        return layout, experts, hidden, inter

    @staticmethod
    def _buffer(name: str, elements: int, dtype: torch.dtype) -> torch.Tensor:
        # The kernel's row buffers (pagellm/ops/scratch.py).
        return thread_scratch("moe", name, elements, dtype)


def _dot_pack(stacked: torch.Tensor) -> torch.Tensor:
    """[E, out, in] bfloat16 -> [E, out / 16, in / 2, 16, 2], each expert as LinearBF16.pack lays it out, in new
    memory advised for huge pages before it is written."""
    experts, out_features, in_features = stacked.shape
    packed = torch.empty(experts, out_features // LinearBF16.PANEL, in_features // 2, LinearBF16.PANEL, 2,
                         dtype=stacked.dtype)
    advise_huge_pages([packed])
    for expert in range(experts):  # one expert's temporary at a time, not the whole stack's
        packed[expert].copy_(LinearBF16.pack(stacked[expert]))
    return packed


def cpu_moe_kernel() -> CpuMoEKernel | None:
    """The native kernel, or None where the library cannot be built or native kernels are switched off. One per
    library, which every MoE layer shares: its row buffers are one step's, not one per layer."""
    library = native_library()
    return _kernel_of(library) if library is not None else None


@functools.cache
def _kernel_of(library: ctypes.CDLL) -> CpuMoEKernel:
    return CpuMoEKernel(library)
