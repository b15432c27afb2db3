"""RMS norms: Llama's (on the fused CPU kernel where the model runs on it, with the residual add folded in) and
Gemma's (scales by 1 + weight)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagellm.ops.cpu_ops import CpuOps


class _ResidualRMSNorm(nn.Module, ABC):
    """norm(x); or, given the residual stream, (norm(x + residual), x + residual): on the fused CPU kernel (the sum
    written into `residual` in place) where `_kernel_weight` gives the weight it multiplies by, else torch ops."""

    # The fused kernels (CPU, float32 or bfloat16) when the model runs on them; else torch ops.
    ops: CpuOps | None = None
    eps: float

    @abstractmethod
    def _kernel_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The weight the fused kernel multiplies by, or None where this call runs on torch ops."""

    @abstractmethod
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """The torch-ops norm of x."""

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm(x, residual, weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = self._kernel_weight(x)
        if weight is not None:
            out = self._kernel(x, residual, weight)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class RMSNorm(_ResidualRMSNorm):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def _kernel_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.weight if self.ops is not None else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics whatever the weights' dtype, as the reference implementation computes them.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(_ResidualRMSNorm):
    """Gemma's: scales by (1 + weight), computed in float32 and rounded back to the activations' dtype. On the
    fused CPU kernel (use_cpu_ops, cpu_ops.c's gemma_rms_norm) for float32 and bfloat16 activations: it multiplies
    by 1 + weight, summed once in float32 as the torch path sums it at every call, rounds once as the torch path
    does, and folds the residual add in as RMSNorm's kernel does. Its sum of squares runs in another order than
    torch's, so a bfloat16 output can differ from the torch path's by one unit in its last place where the
    product lies within a float32 rounding of a bfloat16 tie."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps
        self.offset_weight: torch.Tensor | None = None

    def use_cpu_ops(self, ops: CpuOps | None) -> None:
        """Run on `ops` (None: the torch ops again); call after the weight is loaded."""
        self.ops = ops
        self.offset_weight = None if ops is None else 1.0 + self.weight.detach().float()

    def _kernel_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.ops is not None and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2:
            return self.offset_weight
        return None

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.gemma_rms_norm(x, residual, weight, self.eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
