"""RMS norms: Llama's (on the fused CPU kernel where the model runs on it, with the residual add folded in) and
Gemma's (scales by 1 + weight)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.native import CpuOps


class RMSNorm(nn.Module):
    # The fused kernels (CPU, float32 or bfloat16) when the model runs on them; else torch ops.
    ops: CpuOps | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual)."""
        if self.ops is not None:
            out = self.ops.add_rms_norm(x, residual, self.weight, self.eps)  # adds into residual in place
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics whatever the weights' dtype, as the reference implementation computes them.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's: scales by (1 + weight), computed in float32 and rounded back to the activations' dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
