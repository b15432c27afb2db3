"""compressed-tensors "pack-quantized" checkpoints with integer weights and float activations (W4A16, W8A16:
llm-compressor's GPTQ and round-to-nearest output, vLLM's CompressedTensorsWNA16), on the AWQ/GPTQ kernels.

The checkpoint's tensors per linear module (compressed_tensors/compressors/pack_quantized, 0.20):
  weight_packed      int32 [out_features, in_features / pack], pack = 32 / bits values per word along the INPUT
                     features: bits j*bits .. of word [n, c] hold q[n, c * pack + j] + 2^(bits - 1), q the signed
                     quantized value in [-2^(bits-1), 2^(bits-1));
  weight_scale       [out_features, groups] in the model's float type (groups = 1 per channel);
  weight_zero_point  int32 [out_features / pack, groups], asymmetric schemes only: the signed zero points plus
                     2^(bits - 1), packed the same way along the OUTPUT features;
  weight_g_idx       int32 [in_features], "group" act order only (older llm-compressor): each input's group;
  weight_shape       int [2]: the unpacked weight's shape.
W[n, k] = (q[n, k] - zp[n, g]) * scale[n, g] with g = g_idx[k] (k // group_size without act order): in unsigned
terms, (u - (zp + 2^(bits-1))) * scale, which is the kernels' s * u + o with o = -s * (zp + 2^(bits-1)).
weight_packed is already packed along the inputs as the kernels' qweight is, transposed.

Tensor parallelism as for GPTQ: a row-parallel rank holds a slice of the packed inputs and of the groups (whole
groups), or, with weight_g_idx, every group's scales (its features may belong to any of them).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pagellm.layers.quantization.group_quant import (
    GroupQuantLinearMethod,
    load_shard_row,
    parts_by_input_order,
)
from pagellm.layers.weights import set_weight_attrs
from pagellm.ops.wna16 import BITS, Parts, pack_factor, unpack_rows


class CompressedTensorsWNA16Method(GroupQuantLinearMethod):
    format_name = "compressed-tensors WNA16"

    def __init__(self, bits: int, group_size: int | None, symmetric: bool, group_act_order: bool) -> None:
        """group_size None: one scale per output channel; group_act_order: the checkpoint stores weight_g_idx."""
        if bits not in BITS:
            raise ValueError(f"{bits}-bit weights are not supported; the kernels take {BITS}")
        super().__init__(bits)
        self.group_size = group_size
        self.symmetric = symmetric
        self.group_act_order = group_act_order
        self.pack = pack_factor(bits)
        self.checkpoint_params = (("weight_packed", "weight_scale", "weight_shape")
                                  + (() if symmetric else ("weight_zero_point",))
                                  + (("weight_g_idx",) if group_act_order else ()))

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        pack, output_size = self.pack, sum(output_sizes)
        if input_size % pack:
            raise ValueError(f"{layer.prefix}: {input_size} input features per rank are not a multiple of {pack}, "
                             "which the checkpoint packs weights by; use a smaller tensor_parallel_size")
        if not self.symmetric and any(size % pack for size in output_sizes):
            raise ValueError(f"{layer.prefix}: {output_sizes} output features per shard and rank are not multiples "
                             f"of {pack}, which the checkpoint packs zero points by; use a smaller "
                             "tensor_parallel_size")
        groups, group_dim = self._groups(layer, input_size)
        weight_packed = nn.Parameter(torch.empty(output_size, input_size // pack, dtype=torch.int32),
                                     requires_grad=False)
        set_weight_attrs(weight_packed, input_dim=1, output_dim=0, packed_dim=1, pack_factor=pack)
        # float32 holds a checkpoint's float16 (or bfloat16) scales exactly, whatever the model's dtype.
        weight_scale = nn.Parameter(torch.empty(output_size, groups, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(weight_scale, input_dim=group_dim, output_dim=0)
        shape = nn.Parameter(torch.empty(len(output_sizes), 2, dtype=torch.int64), requires_grad=False)
        set_weight_attrs(shape, weight_loader=functools.partial(load_shard_row, layer, "weight_shape", False))
        layer.register_parameter("weight_packed", weight_packed)
        layer.register_parameter("weight_scale", weight_scale)
        layer.register_parameter("weight_shape", shape)
        if not self.symmetric:
            zero_point = nn.Parameter(torch.empty(output_size // pack, groups, dtype=torch.int32), requires_grad=False)
            set_weight_attrs(zero_point, input_dim=group_dim, output_dim=0, packed_dim=0, pack_factor=pack)
            layer.register_parameter("weight_zero_point", zero_point)
        if self.group_act_order:
            g_idx = nn.Parameter(torch.empty(len(output_sizes), input_size, dtype=torch.int32), requires_grad=False)
            set_weight_attrs(g_idx, weight_loader=functools.partial(load_shard_row, layer, "weight_g_idx", True))
            layer.register_parameter("weight_g_idx", g_idx)

    def _groups(self, layer: nn.Module, input_size: int) -> tuple[int, int | None]:
        """How many groups' scales this rank holds, and the scales' input dimension (None: the rank loads all of
        them, as with one group per channel or with act order)."""
        total_inputs = input_size * (layer.group.size if layer.splits_input else 1)
        if self.group_size is None:
            return 1, None
        if self.group_act_order or not layer.splits_input:
            return -(-total_inputs // self.group_size), None if self.group_act_order else 1
        if input_size % self.group_size:
            raise ValueError(f"{layer.prefix}: {input_size} input features per rank are not whole groups of "
                             f"{self.group_size}; use a smaller tensor_parallel_size")
        return input_size // self.group_size, 1

    def parts(self, layer: nn.Module) -> Parts:
        self._check_shapes(layer)
        scales = layer.weight_scale.data.t().contiguous()  # [groups, out]
        if self.symmetric:
            zeros = torch.full_like(scales, 1 << (self.bits - 1))
        else:
            zeros = unpack_rows(layer.weight_zero_point.data, self.bits).t().to(torch.float32)
        qweight = layer.weight_packed.data.t().contiguous()
        if self.group_act_order:
            g_idx = layer.weight_g_idx.data
        else:
            size = layer.input_size if self.group_size is None else self.group_size
            inputs = torch.arange(layer.input_size, device=qweight.device)
            g_idx = (inputs // size).to(torch.int32).expand(len(layer.output_sizes), -1)
        return parts_by_input_order(layer, self.bits, qweight, scales, -scales * zeros, g_idx)

    def _check_shapes(self, layer: nn.Module) -> None:
        """Each shard's weight_shape against the layer: a checkpoint packed from another shape (or with inputs
        padded to whole words) would otherwise load as wrong weights of the right size."""
        inputs = layer.input_size * (layer.group.size if layer.splits_input else 1)
        expected = [[size, inputs] for size in layer.checkpoint_shard_sizes()]
        found = layer.weight_shape.data.tolist()
        fused = [[sum(size for size, _ in expected), inputs]] * len(expected)  # one tensor for all shards (Phi-3)
        if found not in (expected, fused):
            raise ValueError(f"{layer.prefix}: the checkpoint's weight_shape {found} does not match the layer's "
                             f"shards {expected} ([out_features, in_features] each)")
