"""Dense weights in the model's dtype, multiplied by the kernel ops/dense_linear.py picks for this device."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagellm.layers.weights import set_weight_attrs
from pagellm.ops.dense_linear import DenseKernel, UpcastScratch, choose_dense_kernel


class UnquantizedLinearMethod(LinearMethod):
    def __init__(self) -> None:
        # One per model: its widened layers share a scratch buffer.
        self.scratch = UpcastScratch()

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, input_dim=1, output_dim=0)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not getattr(layer, "serves_matmul", True):
            return  # an embedding table only looked up
        # A tied LM head reads the embedding's table: that tensor must stay.
        kernel, free_plain = choose_dense_kernel(layer.weight.data, getattr(layer, "shares_weight", False),
                                                 self.scratch)
        layer.dense_kernel = kernel
        if free_plain:
            layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel: DenseKernel | None = getattr(layer, "dense_kernel", None)
        if kernel is None:  # not processed (a model used before loading finished, e.g. in a unit test)
            return torch.nn.functional.linear(x, layer.weight, bias)
        return kernel(x, bias)

    def prepared_product(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        kernel: DenseKernel | None = getattr(layer, "dense_kernel", None)
        return None if kernel is None else functools.partial(kernel, bias=None)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(input_ids, layer.weight)

    def kernel_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        kernel = getattr(layer, "dense_kernel", None)
        return kernel.tensors() if kernel is not None else []


class Unquantized(QuantizationConfig):
    """No quantization: every layer dense, all sharing one method (and its scratch buffer)."""

    name = "none"

    def __init__(self) -> None:
        self.method = UnquantizedLinearMethod()

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.method
