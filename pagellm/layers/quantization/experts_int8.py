"""quantization="experts_int8" (vLLM's ExpertsInt8Config): a float mixture-of-experts checkpoint whose experts'
weights are quantized to int8 as they load, one scale per output channel, with activations kept in the model's
dtype (W8A16); every other layer stays as the checkpoint stores it. The experts are linear layers of that format
(ExpertLinearsMoEMethod), on the group-quantized kernels' 8-bit path (csrc/wna16.c on the CPU, Triton on CUDA).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from pagellm.layers.fused_moe import ExpertLinearsMoEMethod
from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import OnlineQuantization, OnlineQuantizedLinearMethod
from pagellm.ops.wna16 import GroupQuantKernel, GroupQuantWeight, choose_kernel, pack_rows

INT8_MAX = 127
# Unsigned 8-bit fields hold q + ZERO_POINT (the group-quantized kernels' representation).
ZERO_POINT = 128


def int8_channel_weight(weight: torch.Tensor) -> GroupQuantWeight:
    """A float weight [N, K] as symmetric int8 per output channel: q = round(w / s) with s = max|w| / 127 per row,
    stored as the group-quantized kernels' 8-bit fields (q + 128) with one group spanning the inputs."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int32) + ZERO_POINT
    return GroupQuantWeight(8, pack_rows(q.t().contiguous(), 8), scale[None, :].contiguous(),
                            (-ZERO_POINT * scale)[None, :].contiguous(),
                            torch.zeros(weight.shape[1], dtype=torch.int32))


class OnlineGroupQuantMethod(OnlineQuantizedLinearMethod):
    """A float weight quantized at load into the group-quantized kernels' representation (`group_weight`),
    activations in the model's dtype; decode steps take the kernel's prepared product."""

    def quantize(self, weight: torch.Tensor) -> GroupQuantKernel:
        return choose_kernel([(0, self.group_weight(weight))], weight.device)

    @abstractmethod
    def group_weight(self, weight: torch.Tensor) -> GroupQuantWeight:
        """One loaded float weight [N, K] in the group-quantized representation."""

    def prepared_product(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        kernel: GroupQuantKernel | None = layer.online_kernel
        return None if kernel is None else kernel.prepared_product() or super().prepared_product(layer)


class OnlineInt8WeightOnlyMethod(OnlineGroupQuantMethod):
    """Per-channel int8 weights quantized as the layer's shards arrive; activations in the model's dtype."""

    def group_weight(self, weight: torch.Tensor) -> GroupQuantWeight:
        return int8_channel_weight(weight)


class ExpertsInt8Config(QuantizationConfig):
    name = "experts_int8"

    def __init__(self) -> None:
        self.dense = UnquantizedLinearMethod()
        # The experts' linear layers ask this config (ExpertLinearsMoEMethod); none is an embedding or a head.
        self.experts = OnlineQuantization(self.name, OnlineInt8WeightOnlyMethod(), "int8 weights per output channel")

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.dense

    def fused_moe_method(self, prefix: str) -> ExpertLinearsMoEMethod:
        return ExpertLinearsMoEMethod(self.experts)

    def describe(self) -> str:
        return ("experts_int8 (online: the mixture-of-experts layers' weights as int8 per output channel, quantized "
                "at load; activations in the model dtype; every other layer unquantized)")


def experts_int8_config(checkpoint_config: dict | None, requested: str | None) -> ExpertsInt8Config:
    """The registry's factory for quantization="experts_int8", on a float checkpoint."""
    return ExpertsInt8Config()
