"""HQQ checkpoints (quant_method "hqq": transformers' HqqConfig, mobiuslabs' "_hqq_hf" models; vLLM's HQQMarlinConfig):
4- or 8-bit weights with a float scale and a float zero per group of inputs, on the group-quantized kernels.

Per linear module the checkpoint stores HQQLinear.state_dict (hqq 0.2's safetensors encoding):
  W_q    the codes, [groups, group_size] with groups = N * K / group_size along each row's inputs (axis 1); 4-bit
         ones packed two to a byte along the first dimension ("4bit_u8": the first half of the rows in the high
         nibbles, the second half in the low ones), "8bit_u8" as they are; in the compute dtype's bytes where
         view_as_float;
  scale, zero  [groups, 1], the compute dtype: W = (q - zero) * scale;
  shape, nbits, group_size, axis, packing, ... the meta data, as small tensors (strings as their bytes).
Each weight reaches its layer unpacked (`checkpoint_tensors`), its zeros as the kernels' offsets (-scale * zero),
exact for HQQ's float zeros. Other bit widths, axis 0 and quantized scales / zeros are refused naming them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagellm.layers.quantization.base import (LinearMethod, QuantizationConfig, grouped_pieces, is_lm_head,
                                             stored_text)
from pagellm.layers.quantization.group_quant import EMBEDDING_SUFFIX, GroupQuantLinearMethod, all_shards_agree
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.weights import set_weight_attrs
from pagellm.ops.wna16 import GroupQuantWeight, Parts, pack_rows

PACKINGS = {"4bit_u8": 4, "8bit_u8": 8}
# HQQLinear's state_dict keys beside W_q / scale / zero; the ones read are checked, the others dropped.
META_KEYS = ("shape", "nbits", "group_size", "axis", "packing", "view_as_float", "unpack_view_dtype", "quant_scale",
             "quant_zero", "compute_dtype", "offload_meta", "encoded_state_dict", "stores_quant_config",
             "channel_wise", "optimize", "round_zero")
NEEDED = ("W_q", "scale", "zero", "shape", "nbits", "group_size", "axis", "packing", "view_as_float")


def unpack_hqq(name: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q uint8 [N, K], scale and zero float32 [N, K / group_size], group_size) of one weight's tensors."""
    rows, cols = (int(v) for v in parts["shape"].flatten())
    bits, group_size, axis = int(parts["nbits"]), int(parts["group_size"]), int(parts["axis"])
    packing = stored_text(parts["packing"])
    if axis != 1 or PACKINGS.get(packing) != bits:
        raise ValueError(f"{name}: HQQ weights of {bits} bits packed {packing!r} along axis {axis}; pagellm reads "
                         "4bit_u8 and 8bit_u8 along axis 1 (each group a run of one row's inputs)")
    if cols % group_size:
        raise ValueError(f"{name}: {cols} input features are no whole groups of {group_size}")
    codes = parts["W_q"]
    if int(parts["view_as_float"]):
        codes = codes.contiguous().view(torch.uint8)
    if bits == 4:
        codes = torch.cat([codes >> 4, codes & 15])
    q = codes.reshape(rows, cols)
    groups = cols // group_size
    scale, zero = (parts[key].float().reshape(rows, groups) for key in ("scale", "zero"))
    return q, scale, zero, group_size


def _hqq_piece(name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
    module, _, key = name.rpartition(".")
    return (module, key) if key in ("W_q", "scale", "zero", *META_KEYS) else None


class HQQLinearMethod(GroupQuantLinearMethod):
    format_name = "HQQ"
    checkpoint_params = ("hqq_q", "hqq_scale", "hqq_zero")

    def __init__(self, bits: int, group_size: int) -> None:
        super().__init__(bits)
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        if input_size % self.group_size:
            raise ValueError(f"{layer.prefix}: {input_size} input features per rank are no whole groups of "
                             f"{self.group_size}; use a smaller tensor_parallel_size")
        output_size = sum(output_sizes)
        q = nn.Parameter(torch.empty(input_size, output_size, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(q, input_dim=0, output_dim=1)
        layer.register_parameter("hqq_q", q)
        for name in ("hqq_scale", "hqq_zero"):
            param = nn.Parameter(torch.empty(input_size // self.group_size, output_size, dtype=torch.float32),
                                 requires_grad=False)
            set_weight_attrs(param, input_dim=0, output_dim=1)
            layer.register_parameter(name, param)

    def parts(self, layer: nn.Module) -> Parts:
        q = layer.hqq_q.data.to(torch.int32)
        scale = layer.hqq_scale.data
        g_idx = (torch.arange(q.shape[0], device=q.device) // self.group_size).to(torch.int32)
        return [(0, GroupQuantWeight(self.bits, pack_rows(q, self.bits), scale, -scale * layer.hqq_zero.data, g_idx))]


class HQQConfig(QuantizationConfig):
    name = "hqq"

    def __init__(self, bits: int, group_size: int, skip_modules: list[str]) -> None:
        self.method = HQQLinearMethod(bits, group_size)
        self.skip_modules = skip_modules
        self.dense = UnquantizedLinearMethod()

    def linear_method(self, prefix: str) -> LinearMethod:
        if prefix.endswith(EMBEDDING_SUFFIX) or is_lm_head(prefix) or all_shards_agree(
                prefix, lambda module: any(name in module for name in self.skip_modules), "skip_modules"):
            return self.dense
        return self.method

    def checkpoint_tensors(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        return grouped_pieces(weights, _hqq_piece, lambda parts: all(k in parts for k in NEEDED), self._kept,
                              "HQQ weight")

    def _kept(self, module: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        if int(parts.get("quant_scale", torch.tensor(0))) or int(parts.get("quant_zero", torch.tensor(0))):
            raise ValueError(f"{module}: HQQ with quantized scales or zeros; pagellm reads float ones")
        q, scale, zero, group_size = unpack_hqq(module, parts)
        if (int(parts["nbits"]), group_size) != (self.method.bits, self.method.group_size):
            raise ValueError(f"{module}: {int(parts['nbits'])}-bit weights in groups of {group_size}, where the "
                             f"config says {self.method.bits} bits in groups of {self.method.group_size}")
        yield f"{module}.hqq_q", q.t().contiguous()
        yield f"{module}.hqq_scale", scale.t().contiguous()
        yield f"{module}.hqq_zero", zero.t().contiguous()

    def describe(self) -> str:
        return (f"hqq ({self.method.bits}-bit weights, a float scale and zero per group of {self.method.group_size} "
                "inputs)")


def hqq_config(config: dict | None, requested: str | None) -> HQQConfig:
    if not config:
        raise ValueError("quantization='hqq' names the format of HQQ checkpoints; this checkpoint is not quantized")
    quant_config = config.get("quant_config") or {}
    if "weight_quant_params" not in quant_config:
        raise ValueError(f"HQQ checkpoint with per-module quant_config {sorted(quant_config)} (HqqConfig's "
                         "dynamic_config): pagellm reads one weight_quant_params for every module")
    params = quant_config["weight_quant_params"]
    bits, group_size, axis = params.get("nbits"), params.get("group_size"), params.get("axis", 1)
    if bits not in PACKINGS.values() or axis != 1 or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"HQQ checkpoint with weight_quant_params {params}: pagellm reads 4- and 8-bit weights in "
                         "groups along axis 1")
    return HQQConfig(bits, group_size, list(config.get("skip_modules") or []))
