"""Gated activations over a fused gate/up product [tokens, 2 * intermediate]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.ops.cpu_ops import CpuOps


class SiluAndMul(nn.Module):
    """silu(gate) * up, on the fused CPU kernel where the model runs on it."""

    ops: CpuOps | None = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up (Gemma's `gelu_pytorch_tanh`)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu_tanh": GeluTanhAndMul}


def gated_activation(name: str | None, where: str = "hidden_act") -> nn.Module:
    """The gated activation `name` (a config's hidden_act), or a ValueError naming the supported ones."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"{where}={name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
