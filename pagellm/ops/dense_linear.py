"""The one place that picks how a dense (unquantized) linear layer multiplies on this device, CPU and dtype.

float32 on AVX2 CPUs: no one CPU GEMM wins at every row count on SmolLM2's shapes. On a 2-core AMD EPYC with
avx2 only (no avx512f), one thread, oneDNN on a pre-packed weight beat F.linear (MKL) 2.6x at 4 rows, 1.6x at
16 and 1.25x at 64 (decode batches); MKL on the plain weight beat oneDNN by 7% at 1024 rows and 12% at 2048
(prefill). So both copies are kept, at the cost of holding the weight twice, and each call takes the faster one
for its row count.
float32 on AVX-512 CPUs, and bfloat16: on a 2-core AMD EPYC with avx2 avx512f avx512_bf16, the packed weight
won at every shape and row count from 1 to 2048 (benchmarks/cpu_gemm.py), so only it is kept and the plain copy
is freed (where no other module shares it: a tied LM head's weight is the embedding table).
bfloat16 where the native kernels have avx512_bf16's dot product: the weight is packed for pagellm's own kernel
(linear_bf16.c), which beat oneDNN's packed weight at every row count there; oneDNN elsewhere. On CPUs with AMX
(amx_bf16) oneDNN's packed weight runs on the tiles and beat that kernel's vector path from 8 rows on, so the
kernel runs its own tile path from there, on the same packed copy (README, "On a CPU with AMX").
Half types on CPUs without instructions for them: torch emulates half matmuls (~20 GFLOP/s against ~170 in
float32 on a 2-core AMD EPYC with avx2 only), so operands are widened to float32 per call and the result rounded
back, the arithmetic of a half GEMM with float32 accumulation, while the weights stay half in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagellm.cpu_features import cpu_flags, cpu_has_native
from pagellm.ops.linear_bf16 import LinearBF16, linear_bf16

# Row count from which MKL on the plain weight is at least as fast as oneDNN (they tie at 512), in float32 on
# CPUs without AVX-512.
FLOAT32_PLAIN_MIN_ROWS = 512


def can_pack_for_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN-packed weights in float32 everywhere, and in bfloat16 where the CPU has bf16 instructions
    (elsewhere half weights are widened to float32 per call instead)."""
    packable = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native(dtype))
    return device.type == "cpu" and packable and torch.backends.mkldnn.is_available()


class DenseKernel:
    """x @ W^T + bias for one layer's weight, in whatever layout this kernel keeps it."""

    name = "plain"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight: torch.Tensor | None = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def tensors(self) -> list[torch.Tensor]:
        """What it holds beside the layer's parameter (counted as weight memory)."""
        return []


class OneDNNPacked(DenseKernel):
    """oneDNN's blocked layout; with `plain_min_rows`, calls of at least that many rows take MKL on the plain
    weight instead."""

    name = "onednn"

    def __init__(self, weight: torch.Tensor, plain_min_rows: int | None) -> None:
        super().__init__(weight)
        # The layout oneDNN picks depends a little on the row count it is told to expect; 64 did best across
        # 4..2048 rows in a sweep.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
        self.plain_min_rows = plain_min_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.plain_min_rows is not None and x.shape[0] >= self.plain_min_rows:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


class NativeBF16Packed(DenseKernel):
    """pagellm's bfloat16 kernel (linear_bf16.c) on its own packed layout."""

    name = "native-bf16"

    def __init__(self, weight: torch.Tensor, kernel: LinearBF16) -> None:
        super().__init__(weight)
        self.kernel = kernel
        self.packed = kernel.pack(weight.detach())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, self.packed, bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


@dataclass
class UpcastScratch:
    """One float32 buffer that every widened layer of a model copies its weight into (they run one at a time):
    widening into a fresh tensor each call would fault in new pages every time (113 MB for SmolLM2's lm_head)."""

    dtype: torch.dtype = torch.float32
    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def reserve(self, numel: int, device: torch.device) -> None:
        if self.buffer.numel() < numel or self.buffer.device != device:
            self.buffer = torch.empty(numel, dtype=self.dtype, device=device)

    def view(self, shape: torch.Size) -> torch.Tensor:
        return self.buffer[: shape.numel()].view(shape)


class Upcast(DenseKernel):
    """A half weight multiplied in float32 (see the module docstring); the result in the input's dtype."""

    name = "upcast"

    def __init__(self, weight: torch.Tensor, scratch: UpcastScratch) -> None:
        super().__init__(weight)
        self.scratch = scratch
        scratch.reserve(weight.numel(), weight.device)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        wide = self.scratch.view(self.weight.shape)
        wide.copy_(self.weight)
        wide_bias = bias.to(self.scratch.dtype) if bias is not None else None
        return F.linear(x.to(self.scratch.dtype), wide, wide_bias).to(x.dtype)


def choose_dense_kernel(weight: torch.Tensor, shared: bool, scratch: UpcastScratch) -> tuple[DenseKernel, bool]:
    """The kernel for this weight, and whether the plain weight may be freed (only the packed copy is read,
    and no other module shares the tensor)."""
    device, dtype = weight.device, weight.dtype
    if device.type != "cpu" or weight.numel() == 0:
        return DenseKernel(weight), False
    if dtype != torch.float32 and not cpu_has_native(dtype):
        return Upcast(weight, scratch), False
    if not can_pack_for_cpu(device, dtype):
        return DenseKernel(weight), False
    native = linear_bf16() if dtype == torch.bfloat16 else None
    out_features, in_features = weight.shape
    if native is not None and native.supports(in_features, out_features):
        return _packed_only(NativeBF16Packed(weight, native), shared)
    if dtype == torch.float32 and "avx512f" not in cpu_flags():
        return OneDNNPacked(weight, FLOAT32_PLAIN_MIN_ROWS), False
    return _packed_only(OneDNNPacked(weight, None), shared)


def _packed_only(kernel: DenseKernel, shared: bool) -> tuple[DenseKernel, bool]:
    """A kernel that reads only its packed copy lets go of the plain weight, so that the caller's freeing it
    frees its memory (a tensor another module shares stays, and so does the kernel's reference)."""
    if shared:
        return kernel, False
    kernel.weight = None
    return kernel, True
